"""Programs that are not language models, served through Triton: the programs, their
repository, and the checks that tests/test_program_server.py asserts and scripts/verify.py
tabulates. Each check returns (what was observed, whether it passed).

- masked_mean: a bounded program (x [L, 4], L at most 16): the masked mean over L and the rows
  minus it.
- rows / rows_nogroup: a stateless generic program under the dynamic batcher, y = x * w + the
  row's sum, over rows of any width w (symbolic), with a weight file; group_by_shape true and
  false.
- dtypes: nine inputs of nine dtypes, each plus one (bool: not).
- running_sum / running_sum_copied: a program with state, total = state + x, the state kept
  between requests (donated; the control copies it).
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np

from triton_tlaloc.programs.bounded import BoundedRuntime, TensorShape
from triton_tlaloc.frontends.client import METRICS_SETTLE_S, metric, scrape_metrics
from triton_tlaloc.export import bounded as export_bounded
from triton_tlaloc.export import program as export_program
from triton_tlaloc.artifact.manifest import numpy_dtype
from triton_tlaloc.repository import ProgramOptions, write_program_repository

BOUND = 16
RAGGED_REQUESTS = 216
RAGGED_WIDTHS = (3, 5)
RAGGED_MAX_BATCH = 16
DTYPES = ("i1", "i8", "i16", "i32", "i64", "ui8", "f16", "bf16", "f32")
DTYPE_INPUTS = [f"X_{d}" for d in DTYPES]
DTYPE_OUTPUTS = [f"Y_{d}" for d in DTYPES]
ROW_SCALE = 3.0


def masked_mean(x, L_mask, L_len):
    import jax.numpy as jnp

    m = L_mask[:, None]
    mean = jnp.where(m, x, 0).sum(0) / L_len
    return mean, jnp.where(m, x - mean, 0)


def rows_program(x, w):
    return x * w[0] + x.sum(-1, keepdims=True)


def plus_one(*xs):
    return tuple(~x if x.dtype == bool else x + 1 for x in xs)


def running_sum(x, state):
    total = state + x
    return total, total


def expected_plus_one(a: np.ndarray) -> np.ndarray:
    return ~a if a.dtype == bool else (a + np.ones((), a.dtype)).astype(a.dtype)


def build_programs(work: Path) -> dict:
    """The bounded artifact and the generic programs (with the rows program's weight file)."""
    work.mkdir(parents=True, exist_ok=True)
    out = {"masked_mean": work / "masked-mean"}
    if not (out["masked_mean"] / "tlaloc-bounded.json").is_file():
        export_bounded(masked_mean, [TensorShape("x", "f32", ("L", 4))], {"L": BOUND},
                       out["masked_mean"])
    out["rows"] = export_program(rows_program, [TensorShape("x", "f32", ("b", "w")),
                                                TensorShape("w", "f32", (1,))],
                                 work / "rows" / "rows.mlir")
    np.array([ROW_SCALE], np.float32).tofile(work / "rows" / "scale.bin")
    out["dtypes"] = export_program(plus_one, [TensorShape(n, d, ("b", 3))
                                              for n, d in zip(DTYPE_INPUTS, DTYPES)],
                                   work / "dtypes" / "dtypes.mlir")
    out["running_sum"] = export_program(running_sum, [TensorShape("x", "f32", (4,)),
                                                      TensorShape("state", "f32", (4,))],
                                        work / "running-sum" / "running_sum.mlir")
    return out


def write_program_models(programs: dict, repo: Path) -> list[str]:
    # A 10 ms queue delay fills the batches even when the sender is slow (a loaded CI box):
    # the check compares how batches are split, so they must hold several requests.
    rows = dict(arguments="input:X,weight:scale.bin", results="output:Y",
                max_batch_size=RAGGED_MAX_BATCH, max_queue_delay_microseconds=10_000)
    sums = dict(arguments="input:X,state:total", results="output:TOTAL,state:total")
    models = {
        "masked_mean": (programs["masked_mean"], ProgramOptions()),
        "rows": (programs["rows"], ProgramOptions(**rows)),
        "rows_nogroup": (programs["rows"], ProgramOptions(**rows, group_by_shape=False)),
        "dtypes": (programs["dtypes"], ProgramOptions(
            arguments=",".join(f"input:{n}" for n in DTYPE_INPUTS),
            results=",".join(f"output:{n}" for n in DTYPE_OUTPUTS), max_batch_size=8)),
        "running_sum": (programs["running_sum"], ProgramOptions(**sums)),
        "running_sum_copied": (programs["running_sum"], ProgramOptions(**sums,
                                                                        donate_state=False)),
    }
    for name, (source, opts) in models.items():
        write_program_repository(source, repo, name, opts)
    return list(models)


# ------------------------------------------------------------------ clients

def _client(url: str, protocol: str):
    if protocol == "http":
        import tritonclient.http as t

        return t, t.InferenceServerClient(url, concurrency=8)
    import tritonclient.grpc as t

    return t, t.InferenceServerClient(url)


def infer(url: str, protocol: str, model: str, inputs: dict[str, np.ndarray],
          outputs: list[str]) -> dict[str, np.ndarray]:
    """One request; raises tritonclient's InferenceServerException on an error response."""
    from tritonclient.utils import np_to_triton_dtype

    t, client = _client(url, protocol)
    try:
        tensors = []
        for name, a in inputs.items():
            ti = t.InferInput(name, list(a.shape), np_to_triton_dtype(a.dtype))
            ti.set_data_from_numpy(a)
            tensors.append(ti)
        result = client.infer(model, tensors, outputs=[t.InferRequestedOutput(n)
                                                       for n in outputs])
        return {n: result.as_numpy(n) for n in outputs}
    finally:
        client.close()


def _error_text(fn) -> str:
    try:
        fn()
    except Exception as e:  # tritonclient's InferenceServerException
        return str(e)
    return "(no error)"


# ------------------------------------------------------------------ checks

def check_bounded_every_length(url: str, protocol: str, seed: int = 0):
    """Every length 1..BOUND through Triton equals the exact-size result; BOUND + 1 refused."""
    rng = np.random.default_rng(seed)
    worst, equal = 0.0, 0
    for n in range(1, BOUND + 1):
        x = rng.standard_normal((n, 4)).astype(np.float32)
        got = infer(url, protocol, "masked_mean", {"x": x}, ["output_0", "output_1"])
        mean = x.mean(0)
        diff = max(float(np.max(np.abs(got["output_0"] - mean))),
                   float(np.max(np.abs(got["output_1"] - (x - mean)))))
        worst = max(worst, diff)
        equal += got["output_1"].shape == (n, 4) and diff <= 1e-5
    past = _error_text(lambda: infer(url, protocol, "masked_mean",
                                     {"x": np.ones((BOUND + 1, 4), np.float32)}, ["output_0"]))
    refused = f"past its bound {BOUND}" in past
    return (f"{equal}/{BOUND} lengths equal (worst {worst:.1e}, tolerance 1e-5); length "
            f"{BOUND + 1}: {past[:90]!r}", equal == BOUND and refused)


def unmasked_mean(x, L_mask, L_len):
    """The wrong variant: the mean over the whole padded bucket (reads its padding)."""
    mean = x.mean(0)
    return mean, x - mean


def check_bounded_negative_control(work: Path, seed: int = 0):
    """The tolerance tells a wrong program: the unmasked mean, exported with the exporter's
    padding check turned off, run by BoundedRuntime, fails it at every length that is not a
    bucket (and the exporter, with its check on, refuses it)."""
    from triton_tlaloc.programs.bounded import BoundedError

    try:
        export_bounded(unmasked_mean, [TensorShape("x", "f32", ("L", 4))], {"L": BOUND},
                       work / "unmasked-mean-refused")
        refused = "(not refused)"
    except BoundedError as e:
        refused = str(e)
    art = export_bounded(unmasked_mean, [TensorShape("x", "f32", ("L", 4))], {"L": BOUND},
                         work / "unmasked-mean", check_lengths=0)
    runtime = BoundedRuntime(art)
    rng = np.random.default_rng(seed)
    lengths = [n for n in range(1, BOUND + 1) if n & (n - 1)]  # not a bucket: padding exists
    caught = 0
    for n in lengths:
        x = rng.standard_normal((n, 4)).astype(np.float32)
        got = runtime.run({"x": x})[0]
        caught += float(np.max(np.abs(got - x.mean(0)))) > 1e-5
    ok = caught == len(lengths) and "reads its padding" in refused
    return (f"{caught}/{len(lengths)} padded lengths fail the tolerance; the exporter: "
            f"{refused[:60]!r}", ok)


def _ragged_requests(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    widths = rng.choice(RAGGED_WIDTHS, RAGGED_REQUESTS)
    return [rng.integers(-50, 50, (1, int(w))).astype(np.float32) for w in widths]


def send_concurrently(grpc_url: str, model: str, xs: list[np.ndarray]) -> list[np.ndarray]:
    """Every request at once (gRPC async_infer), answers in request order."""
    import tritonclient.grpc as t

    client = t.InferenceServerClient(grpc_url)
    answers: list = [None] * len(xs)
    done = threading.Semaphore(0)

    def callback(i, result, error):
        answers[i] = error if error is not None else result.as_numpy("Y")
        done.release()

    try:
        for i, x in enumerate(xs):
            ti = t.InferInput("X", list(x.shape), "FP32")
            ti.set_data_from_numpy(x)
            client.async_infer(model, [ti], outputs=[t.InferRequestedOutput("Y")],
                               callback=lambda result, error, i=i: callback(i, result, error))
        for _ in xs:
            if not done.acquire(timeout=120):
                raise TimeoutError(f"{model}: not every request was answered in 120 s")
    finally:
        client.close()
    for a in answers:
        if isinstance(a, Exception):
            raise a
    return answers


def executions(metrics_url: str, model: str) -> tuple[float, float]:
    """(the backend's executions, the batches Triton formed) of a model so far."""
    m = scrape_metrics(metrics_url, prefix="", settle_s=METRICS_SETTLE_S)
    return (metric(m, "tlaloc_program_executions_total", model=model),
            metric(m, "nv_inference_exec_count", model=model))


def check_ragged_batch(grpc_url: str, metrics_url: str, seed: int = 0):
    """216 requests of two widths sent at once, to rows (group_by_shape true) and rows_nogroup:
    fewer executions grouped, every request's rows identical either way and to numpy."""
    xs = _ragged_requests(seed)
    want = [x * ROW_SCALE + x.sum(-1, keepdims=True) for x in xs]
    counts, got = {}, {}
    for model in ("rows", "rows_nogroup"):
        before = executions(metrics_url, model)
        got[model] = send_concurrently(grpc_url, model, xs)
        after = executions(metrics_url, model)
        counts[model] = (int(after[0] - before[0]), int(after[1] - before[1]))
    same = all(np.array_equal(a, b) for a, b in zip(got["rows"], got["rows_nogroup"]))
    exact = all(np.array_equal(a, w) for a, w in zip(got["rows"], want))
    (g, gb), (n, nb) = counts["rows"], counts["rows_nogroup"]
    return (f"group_by_shape true: {g} executions ({gb} Triton batches); false: {n} executions "
            f"({nb} batches); rows identical: {same}; equal to numpy: {exact}",
            g < n and same and exact)


def check_dtypes(url: str, protocol: str, seed: int = 0):
    """Each of nine dtypes round-trips through plus-one (bool: not), two rows of three."""
    import ml_dtypes

    rng = np.random.default_rng(seed)
    inputs = {}
    for name, d in zip(DTYPE_INPUTS, DTYPES):
        dt = numpy_dtype(d)
        if d == "bf16":
            dt = np.dtype(ml_dtypes.bfloat16)
        inputs[name] = (rng.integers(0, 2, (2, 3)).astype(bool) if d == "i1" else
                        rng.integers(0, 100, (2, 3)).astype(dt))
    got = infer(url, protocol, "dtypes", inputs, DTYPE_OUTPUTS)
    good = []
    for d, i, o in zip(DTYPES, DTYPE_INPUTS, DTYPE_OUTPUTS):
        want = expected_plus_one(inputs[i])
        good.append(d if got[o].dtype == want.dtype and np.array_equal(got[o], want) else
                    f"{d} WRONG ({got[o].dtype})")
    return (f"{sum(g in DTYPES for g in good)}/9: {', '.join(good)}",
            all(g in DTYPES for g in good))


def check_running_sum(url: str, protocol: str, metrics_url: str, steps: int = 20, seed: int = 0):
    """A program with state: each TOTAL is the previous TOTAL plus x, across requests; the
    state stays at its address every run; the control (donate_state false) gives the same
    totals and copies the state every run."""
    rng = np.random.default_rng(seed)
    xs = [rng.integers(-9, 10, 4).astype(np.float32) for _ in range(steps)]
    totals, runs = {}, {}
    for model in ("running_sum", "running_sum_copied"):
        before = scrape_metrics(metrics_url, prefix="", settle_s=METRICS_SETTLE_S)
        totals[model] = [infer(url, protocol, model, {"X": x}, ["TOTAL"])["TOTAL"] for x in xs]
        after = scrape_metrics(metrics_url, prefix="", settle_s=METRICS_SETTLE_S)
        runs[model] = {s: int(metric(after, "tlaloc_program_state_runs_total", model=model,
                                     state=s) - metric(before, "tlaloc_program_state_runs_total",
                                                       model=model, state=s))
                       for s in ("in_place", "copied")}
    kept = {}
    for model, ts in totals.items():  # the state before the first step may hold earlier sums
        base = ts[0] - xs[0]
        kept[model] = all(np.array_equal(t, base + np.sum(xs[:k + 1], axis=0))
                          for k, t in enumerate(ts))
    same_steps = all(np.array_equal(a - totals["running_sum"][0], b - totals[
        "running_sum_copied"][0]) for a, b in zip(totals["running_sum"],
                                                  totals["running_sum_copied"]))
    ok = (kept["running_sum"] and kept["running_sum_copied"] and same_steps
          and runs["running_sum"] == {"in_place": steps, "copied": 0}
          and runs["running_sum_copied"] == {"in_place": 0, "copied": steps})
    return (f"totals kept over {steps} requests: {kept['running_sum']}; state in place "
            f"{runs['running_sum']['in_place']}/{steps}; control copied "
            f"{runs['running_sum_copied']['copied']}/{steps}, same steps: {same_steps}", ok)


def check_refusals(url: str, protocol: str):
    """Bad requests refused by name, the state untouched: a wrong width to running_sum, a
    wrong dtype to rows."""
    before = infer(url, protocol, "running_sum", {"X": np.zeros(4, np.float32)}, ["TOTAL"])
    wide = _error_text(lambda: infer(url, protocol, "running_sum",
                                     {"X": np.ones(5, np.float32)}, ["TOTAL"]))
    after = infer(url, protocol, "running_sum", {"X": np.zeros(4, np.float32)}, ["TOTAL"])
    dtype = _error_text(lambda: infer(url, protocol, "rows", {"X": np.ones((1, 3), np.int32)},
                                      ["Y"]))
    ok = ("X" in wide and "[4]" in wide and np.array_equal(before["TOTAL"], after["TOTAL"])
          and ("X" in dtype and ("f32" in dtype or "FP32" in dtype)))
    return f"width: {wide[:70]!r}; dtype: {dtype[:70]!r}; state unchanged", ok

