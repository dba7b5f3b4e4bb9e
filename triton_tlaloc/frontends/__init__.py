"""What clients talk to, in front of the sequence model (docs/design.md#front-ends).

    client.py          TlalocClient over tritonclient (HTTP or gRPC); `tlaloc generate`
    generate_model.py  the decoupled generate model: BLS steps, sampling, streamed text
    local_streams.py   its local loop: the link to the sequence model, token frames into text
    openai_server.py   `tlaloc openai`: the OpenAI-compatible HTTP server over the generate models
    openai_responses.py  its answers: completion bodies, server-sent events, HTTP statuses
    http_doors.py      what `tlaloc openai` lets in: Host, CORS, API key, body size and type, 429
    sampling.py        sampling parameters, the sampler, incremental text and stop strings
    parameters.py      the checks of the generate model's request parameters
    drafting.py        drafters for speculative decoding: prompt lookup and its n-gram index
    speculative.py     the generate model's speculation: the `speculative` parameter, draft length
    tokenizer.py       the artifact's tokenizer and chat template
"""
