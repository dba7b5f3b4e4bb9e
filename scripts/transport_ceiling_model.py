"""The transport's ceiling: a Triton Python-backend model that does nothing but answer.

scripts/transport_bench.py serves it under the sequence model's own config.pbtxt (sequence
batcher, control inputs, batch size, outputs) next to the real model. It answers the way the
sequence model does: execute() takes each request's response sender and returns at once, and
one thread of its own sends each request one final response holding the same outputs (zero
LOGITS of the vocabulary's size, ARGMAX, KV_PAGES). What it serves per second is what the
server, the Python backend's IPC and the client allow with no model at all: the limit every
figure of the real model is a ratio of.
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
        self.thread = threading.Thread(target=self._answer, daemon=True)
        self.thread.start()

    def execute(self, requests):
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
        self.queue.put(None)
        self.thread.join(5)
