"""The transport's ceiling: a Triton Python-backend model that does nothing but answer.

scripts/transport_bench.py serves it under the sequence model's own config.pbtxt (sequence
batcher, control inputs, batch size, outputs) next to the real model. By default it answers the
way the sequence model does: execute() takes each request's response sender and returns at once,
and one thread of its own sends each request one final response holding the outputs it asked for
(zero LOGITS of the vocabulary's size, ARGMAX, KV_PAGES). What it serves per second is what the
server, the Python backend's IPC and the client allow with no model at all: the limit every
figure of the real model is a ratio of.

Parameter sender_threads: how many threads send (default: the config's `reply_threads`, as the
sequence model; each request is sent by one of them); 0 answers from execute() instead, every
response of the call returned together (the Python backend passes them to Triton in one
message, not one round trip each).
"""

from __future__ import annotations

import queue
import threading

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        import json

        config = json.loads(args["model_config"])
        vocab = next(o["dims"][0] for o in config["output"] if o["name"] == "LOGITS")
        self.outputs = {"LOGITS": np.zeros((1, int(vocab)), np.float32),
                        "ARGMAX": np.zeros((1, 1), np.int32),
                        "KV_PAGES": np.zeros((1, 2), np.int32)}
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        threads = int(params.get("sender_threads", params.get("reply_threads", "2")))
        self.threads = [threading.Thread(target=self._answer, daemon=True)
                        for _ in range(threads)]
        for t in self.threads:
            t.start()

    def execute(self, requests):
        if not self.threads:  # sender_threads 0: answered from execute(), one message for all
            return [pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor(n, v) for n, v in self.outputs.items()
                if n in r.requested_output_names()]) for r in requests]
        for r in requests:
            self.queue.put((r.get_response_sender(), set(r.requested_output_names())))
        return None

    def _answer(self):
        while True:
            item = self.queue.get()
            if item is None:
                return
            sender, wanted = item
            tensors = [pb_utils.Tensor(n, v) for n, v in self.outputs.items() if n in wanted]
            sender.send(pb_utils.InferenceResponse(output_tensors=tensors),
                        flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def finalize(self):
        for t in self.threads:
            self.queue.put(None)
        for t in self.threads:
            t.join(5)
