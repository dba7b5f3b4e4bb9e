"""What clients talk to, in front of the served models (docs/design.md#front-ends).

    client.py          TlalocClient over tritonclient (HTTP or gRPC); `tlaloc generate`
    openai_server.py   `tlaloc openai`: the OpenAI-compatible HTTP server over the generate models
    openai_responses.py  its answers: completion bodies, server-sent events, HTTP statuses
    http_doors.py      what `tlaloc openai` lets in: Host, CORS, API key, body size and type, 429
    tokenizer.py       the artifact's tokenizer and chat template

The generate model itself is Triton glue (triton/generate_model.py; generate_model.py here is
the old path repositories written before import); sampling, speculation and the local loop are
generation/.
"""
