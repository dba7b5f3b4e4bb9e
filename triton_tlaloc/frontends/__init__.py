"""What clients talk to, in front of the sequence model (docs/architecture.md, "Front ends").

    client.py          TlalocClient over tritonclient (HTTP or gRPC); `tlaloc generate`
    generate_model.py  the decoupled generate model: BLS steps, sampling, streamed text
    openai_server.py   `tlaloc openai`: the OpenAI-compatible HTTP server over the generate models
    openai_responses.py  its answers: completion bodies, server-sent events, HTTP statuses
    http_doors.py      what `tlaloc openai` lets in: Host, CORS, API key, body size and type, 429
    sampling.py        sampling parameters, the sampler, incremental text and stop strings
    tokenizer.py       the artifact's tokenizer and chat template
"""
