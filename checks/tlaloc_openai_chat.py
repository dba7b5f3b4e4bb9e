"""A chat answered by `tlaloc openai` for an artifact (a tritonserver serving it, the OpenAI front
end in this process), greedy: what the vLLM lane compares `vllm serve`'s answer with. Run in
make test's environment:

    python -m checks.tlaloc_openai_chat ARTIFACT '[{"role": "user", "content": "..."}]' MAX_TOKENS

prints one JSON line: {"text": the answer, "streamed": the streamed pieces joined}."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path


def main(argv: list[str]) -> int:
    import openai

    from triton_tlaloc.frontends.openai_requests import ServedModel
    from triton_tlaloc.frontends.openai_server import serve_in_thread
    from triton_tlaloc.repository import RepositoryOptions, write_repository
    from triton_tlaloc.triton.server import TritonServer

    art, messages, max_tokens = Path(argv[0]), json.loads(argv[1]), int(argv[2])
    with tempfile.TemporaryDirectory(prefix="tlaloc-openai-chat-") as tmp:
        write_repository(art, Path(tmp) / "repo", "m", RepositoryOptions())
        with TritonServer(Path(tmp) / "repo", exit_timeout_s=3).start(wait_compiled=False) as srv:
            url, stop = serve_in_thread(srv.grpc_url, {"m": ServedModel.discover(srv.grpc_url,
                                                                                 "m")})
            try:
                client = openai.OpenAI(base_url=url, api_key="unused")
                ask = dict(model="m", messages=messages, temperature=0, max_tokens=max_tokens)
                text = client.chat.completions.create(**ask).choices[0].message.content
                streamed = "".join(c.choices[0].delta.content or "" for c in
                                   client.chat.completions.create(**ask, stream=True)
                                   if c.choices)
            finally:
                stop()
    print(json.dumps({"text": text, "streamed": streamed}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
