"""DeepSeek-V4.1 at long sequences on the CPU: time and peak memory of a training step with the
sparse attention (``attention_impl: sparse``, ``models/deepseek_v41/v41_sparse_attention.py``
and the blocked indexer of ``v41_csa.py``), against NeMo Automodel 0.7.0's eager reference and
against the project's dense oracle (docs/deepseek-v41.md 'Long sequences').

Modes (every measurement in a fresh process: peak RSS is that process's ``ru_maxrss``):

- default, "linear": the tiny preset widened (hidden 256, 8 heads of 64, 6 layers, one of every
  CSA2 kind: window; full at ratio 2; reindex; reuse; full at ratio 1, the candidate source;
  reindex inside the candidates; Engram off), float32, batch 1, forward + backward of the mean
  cross entropy over all tokens. Ours at ``--lengths``, NeMo's ``DeepseekV41ForCausalLM``
  (backend attention 'eager', linear 'torch', rms_norm 'torch_fp32') on the same weights at
  ``--nemo-lengths``, interleaved (ours, NeMo, ours, NeMo, ...); ``--dense`` adds our dense
  oracle (``attention_impl: dense``) at ``--dense-lengths``. Each process times ``--steps``
  steps after one warm-up (median) and prints the loss; NeMo's CSA2 top-k takes the project's
  tie rule (the lower key index, ``v41_csa.ordered_top``; tests/v41_reference.py), so the
  losses agree. Prints the table and the ratios ours(2L)/ours(L), ours/NeMo.
- ``--real-shape``: one ``DeepseekV41Attention`` at V4.1-Flash's shapes (the released defaults of
  ``DeepseekV41BackboneArgs``), float32, forward + backward at ``--real-seq`` (16384): layer 20
  (full at ratio 1, the candidate source, with its indexer) and a full layer at ratio 4 (layer
  2 with ratio 4 in place of 2). Peak RSS per phase, time, and the bytes autograd keeps.
- ``--tiny-32k``: the trainer on ``model=deepseek_v41_tiny`` at ``train.seq_length=32768``, one
  process, 3 steps: loss per step, step time, peak RSS.

    python benchmarks/bench_v41_long.py [--lengths 2048 4096 8192] [--nemo-lengths 2048 4096]
        [--steps 3] [--dense] [--dense-lengths 2048 4096] [--out PATH.json]
    python benchmarks/bench_v41_long.py --real-shape [--real-seq 16384] [--rss-limit-gib 20]
    python benchmarks/bench_v41_long.py --tiny-32k
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench_common import free_port, write_result

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
SIDE = REPO / ".v41-ref"
GIB = 1 << 30
# the tiny preset's schedule on 6 layers, widened (docs/deepseek-v41.md 'Long sequences')
LONG_FIELDS = dict(
    hidden_size=256, num_hidden_layers=6, num_attention_heads=8, head_dim=64,
    q_lora_rank=128, o_lora_rank=128, o_groups=2, sliding_window=128,
    compress_ratios=[0, 2, 2, 2, 1, 1], kv_source_layer_ids=[1, 4],
    index_source_layer_ids=[1, 2, 4, 5], candidate_source_layer_id=4,
    index_n_heads=4, index_head_dim=64, index_topk=64, candidate_topk_blocks=64,
    candidate_block_size=4, moe_intermediate_size=256,
)
RESULT_TAG = "RESULT "


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192])
    p.add_argument("--nemo-lengths", type=int, nargs="*", default=[2048, 4096],
                   help="lengths NeMo's reference runs at (8192 needs about 50 GiB)")
    p.add_argument("--dense", action="store_true", help="also our dense oracle path")
    p.add_argument("--dense-lengths", type=int, nargs="*", default=[2048, 4096])
    p.add_argument("--no-fake-quantize", action="store_true",
                   help="both sides without the FP8/FP4 rounding (ours: fake_quantize false; "
                        "NeMo: quantize_cache the identity): losses then agree to ~1e-7")
    p.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up")
    p.add_argument("--real-shape", action="store_true")
    p.add_argument("--real-seq", type=int, default=16384)
    p.add_argument("--real-cases", nargs="+", default=["ratio1", "ratio4"])
    p.add_argument("--tiny-32k", action="store_true")
    p.add_argument("--tiny-seq", type=int, default=32768)
    p.add_argument("--rss-limit-gib", type=float, default=20.0,
                   help="a child stops itself (exit 3) above this RSS")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: default)")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--child", choices=("weights", "ours", "dense", "nemo", "real"),
                   help=argparse.SUPPRESS)
    p.add_argument("--seq", type=int, help=argparse.SUPPRESS)
    p.add_argument("--case", help=argparse.SUPPRESS)
    p.add_argument("--weights", type=Path, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# --- inside a child process -----------------------------------------------------------------


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


class Watch:
    """Samples this process's RSS every 10 ms: the highest per phase, and a stop (exit 3)
    above `limit` bytes, so a case that does not fit never takes the host's memory."""

    def __init__(self, limit: float) -> None:
        self.limit, self.phase, self.peaks = limit, "start", {}
        threading.Thread(target=self._run, daemon=True).start()

    def set(self, phase: str) -> None:
        self.phase = phase

    def _run(self) -> None:
        while True:
            rss = rss_bytes()
            self.peaks[self.phase] = max(self.peaks.get(self.phase, 0), rss)
            if rss > self.limit:
                report({"stopped": self.phase, "rss": rss, "peaks": self.peaks})
                os._exit(3)
            time.sleep(0.01)


def report(result: dict) -> None:
    print(RESULT_TAG + json.dumps(result), flush=True)


def one_rank() -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    os.environ["WORLD_SIZE"], os.environ["RANK"] = "1", "0"
    from engram_train.runtime import ParallelSizes, initialize_distributed

    initialize_distributed(ParallelSizes())


def model_section(impl: str = "sparse", quantize: bool = True) -> dict:
    from engram_train.models.presets import model_preset

    return dict(model_preset("deepseek_v41_tiny"), **LONG_FIELDS, use_engram=False,
                attention_impl=impl, fake_quantize=quantize, engram_tokenizer_name_or_path=str(
                    REPO / "examples" / "data" / "tokenizer" / "tokenizer.json"))


def tokens(seq: int, vocab: int):
    import torch

    ids = torch.randint(0, vocab, (1, seq + 1), generator=torch.Generator().manual_seed(7))
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


PARTS: dict[str, float] = {}
"""Seconds per part of the current step (`time_parts`)."""


def _timed(name: str, fn):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            PARTS[name] = PARTS.get(name, 0.0) + time.perf_counter() - start

    return wrapper


def time_parts() -> None:
    """Our step's time per part: the indexer (forward only: frozen), the compressor, the sparse
    attention core's forward and backward, the cross entropy's output layer (the rest: the
    projections, the MoE, mHC, norms)."""
    from engram_train.models.deepseek_v41 import v41_csa, v41_sparse_attention

    v41_csa.DeepseekV41Indexer.forward = _timed("indexer", v41_csa.DeepseekV41Indexer.forward)
    v41_csa.DeepseekV41Compressor.forward = _timed("compressor forward",
                                                   v41_csa.DeepseekV41Compressor.forward)
    core = v41_sparse_attention.SparseAttention
    core.forward = staticmethod(_timed("sparse core forward", core.forward))
    core.backward = staticmethod(_timed("sparse core backward", core.backward))


def timed_steps(step, steps: int, watch: Watch) -> dict:
    """One warm-up, then `steps` timed; each step returns its loss."""
    watch.set("warm-up")
    loss = step()
    times, cpu, parts = [], [], []
    for i in range(steps):
        watch.set(f"step {i + 1}")
        PARTS.clear()
        start, start_cpu = time.perf_counter(), time.process_time()
        again = step()
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
        parts.append(dict(PARTS))
        assert again == loss, (again, loss)  # no optimizer step: the same loss every step
    median = sorted(range(steps), key=times.__getitem__)[steps // 2]
    return {"loss": loss, "seconds": times, "median_s": statistics.median(times),
            "cpu_seconds": cpu, "median_cpu_s": statistics.median(cpu), "parts_s": parts[median]}


def child_weights(a) -> None:
    """NeMo's model on the widened fields, initialised as tests/test_deepseek_v41_model.py does
    (weights moved away from their init), saved with its text config."""
    import torch

    import v41_reference as ref
    from test_deepseek_v41_model import nemo_weights_moved

    from engram_train.engram.variant import v41_engram_args
    from engram_train.models.deepseek_v41.v41_config import V41_FIELDS, deepseek_v41_config

    section = model_section()
    ours = deepseek_v41_config(dict(section, use_engram=True),
                               dict(params_dtype=torch.float32, perform_initialization=False))
    backbone = {k: v for k, v in section.items() if k in V41_FIELDS and k != "hidden_size"}
    text = ref.text_config(v41_engram_args(ours), ours.hidden_size, **backbone).to_dict()
    text.update(engram_layer_ids=[], engram_num_embeddings=[])
    model = nemo_weights_moved(text)
    config = model.config
    torch.save({"text": text, "vocab": config.text_config.vocab_size,
                "state": model.state_dict()}, a.weights)
    report({"vocab": config.text_config.vocab_size,
            "parameters": sum(p.numel() for p in model.parameters())})


def child_ours(a, impl: str) -> None:
    import torch

    from engram_train.models.builder import build_gpt_model
    from engram_train.models.deepseek_v41.v41_config import deepseek_v41_config
    from test_deepseek_v41_model import our_state_dict

    watch = Watch(a.rss_limit_gib * GIB)
    one_rank()
    saved = torch.load(a.weights)
    config = deepseek_v41_config(model_section(impl, not a.no_fake_quantize),
                                 dict(params_dtype=torch.float32, perform_initialization=False))
    model = build_gpt_model(config, saved["vocab"], a.seq)
    missing, unexpected = model.load_state_dict(our_state_dict(saved["state"]), strict=False)
    assert not unexpected and all(k.endswith("_extra_state") for k in missing), (missing,
                                                                                  unexpected)
    del saved
    ids, targets = tokens(a.seq, model.output_layer.weight.shape[0])
    if impl == "sparse":
        time_parts()

    def step() -> float:
        model.zero_grad(set_to_none=True)
        loss = model(ids, labels=targets).mean()
        loss.backward()
        return loss.item()

    built = rss_bytes()
    result = timed_steps(step, a.steps, watch)
    report(dict(result, threads=torch.get_num_threads(), rss_built=built, peak=peak_bytes(),
                phase_peaks=watch.peaks))


def child_nemo(a) -> None:
    import torch
    from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41Config
    from nemo_automodel.components.models.deepseek_v41.model import DeepseekV41ForCausalLM

    import v41_reference as ref
    from test_deepseek_v41_blocks import eager_experts, nemo_backend

    watch = Watch(a.rss_limit_gib * GIB)
    if a.no_fake_quantize:
        from nemo_automodel.components.models.deepseek_v41 import attention

        attention.quantize_cache = lambda x, **_: x
    saved = torch.load(a.weights)
    config = DeepseekV41Config(text_config=saved["text"], vision_config={"num_hidden_layers": 0})
    model = DeepseekV41ForCausalLM(config, backend=nemo_backend(), tokenizer=ref.tokenizer())
    model.load_state_dict(saved["state"])
    for layer in model.model.layers.values():
        eager_experts(layer.ffn)
    vocab = saved["vocab"]
    del saved
    ids, targets = tokens(a.seq, vocab)

    def step() -> float:
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=ids).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1))
        loss.backward()
        return loss.item()

    built = rss_bytes()
    with ref.tie_defined_topk():  # the project's tie rule in NeMo's CSA2 selections
        result = timed_steps(step, a.steps, watch)
    report(dict(result, threads=torch.get_num_threads(), rss_built=built, peak=peak_bytes(),
                phase_peaks=watch.peaks))


def real_args(case: str):
    """V4.1-Flash's attention fields; ``ratio4``: layers 2..19 at ratio 4 (released: 2)."""
    from engram_train.models.deepseek_v41.v41_args import DeepseekV41BackboneArgs

    if case == "ratio1":
        return DeepseekV41BackboneArgs(), 20
    if case == "ratio4":
        return DeepseekV41BackboneArgs(compress_ratios=(0, 0) + (4,) * 18 + (1,) * 20 + (0,) * 3), 2
    raise SystemExit(f"unknown real-shape case {case!r}")


def child_real(a) -> None:
    """One attention layer at V4.1-Flash's shapes: forward + backward, peak RSS per phase, the
    bytes the forward leaves for the backward (autograd's saved tensors, by storage)."""
    import torch
    from megatron.core.model_parallel_config import ModelParallelConfig

    from engram_train.models.deepseek_v41.v41_attention import DeepseekV41Attention
    from engram_train.models.deepseek_v41.v41_csa import CSAState

    watch = Watch(a.rss_limit_gib * GIB)
    one_rank()
    args, layer_id = real_args(a.case)
    config = ModelParallelConfig(use_cpu_initialization=True, perform_initialization=False,
                                 params_dtype=torch.float32)
    torch.manual_seed(0)
    attn = DeepseekV41Attention(args, layer_id, config)
    role = args.role(layer_id)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(a.seq, 1, args.hidden_size, generator=g).requires_grad_()
    upstream = torch.randn(a.seq, 1, args.hidden_size, generator=g)
    saved: dict[int, tuple] = {}

    def pack(t):
        if t.device.type == "cpu" and t.untyped_storage().nbytes():
            storage = t.untyped_storage()
            saved.setdefault(storage.data_ptr(), (storage.nbytes(), tuple(t.shape), str(t.dtype)))
        return t

    built = rss_bytes()
    watch.set("forward")
    start = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y, state = attn(x, CSAState())
    forward_s = time.perf_counter() - start
    after_forward = rss_bytes()
    watch.set("backward")
    start = time.perf_counter()
    y.backward(upstream)
    backward_s = time.perf_counter() - start
    weights = sum(p.numel() * p.element_size() for p in attn.parameters())
    largest = sorted(saved.values(), reverse=True)[:12]
    report({"case": a.case, "layer_id": layer_id, "kind": role.kind, "ratio": role.compress_ratio,
            "candidate_source": role.candidate_source, "seq": a.seq,
            "threads": torch.get_num_threads(), "forward_s": forward_s, "backward_s": backward_s,
            "rss_built": built, "rss_after_forward": after_forward, "peak": peak_bytes(),
            "phase_peaks": watch.peaks, "weight_bytes": weights,
            "saved_bytes": sum(n for n, _, _ in saved.values()), "saved_largest": largest,
            "selected": list(state.topk_indices.shape)})


# --- the parent -----------------------------------------------------------------------------


def run_child(a, kind: str, *extra, nemo: bool = False) -> dict:
    """One fresh process; its RESULT line (exit 3: it stopped at the RSS limit)."""
    paths = [str(REPO / "tests"), str(REPO / "benchmarks")]
    if nemo:
        paths.insert(0, str(SIDE))  # NeMo's pinned transformers first
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths), PYTHONUNBUFFERED="1")
    cmd = [sys.executable, __file__, "--child", kind, "--steps", str(a.steps),
           "--rss-limit-gib", str(a.rss_limit_gib), "--threads", str(a.threads),
           *(["--no-fake-quantize"] if a.no_fake_quantize else []), *map(str, extra)]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_TAG)]
    if not lines:
        raise SystemExit(f"{kind} {extra} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n"
                         f"{proc.stderr[-4000:]}")
    result = json.loads(lines[-1][len(RESULT_TAG):])
    result["process_s"] = time.perf_counter() - start
    result["exit"] = proc.returncode
    return result


def gib(n) -> str:
    return f"{n / GIB:.2f}"


def main_linear(a) -> None:
    cases = []
    for seq in a.lengths:
        cases.append(("ours", seq))
        if seq in a.nemo_lengths:
            cases.append(("nemo", seq))
        if a.dense and seq in a.dense_lengths:
            cases.append(("dense", seq))
    results: dict[str, dict[int, dict]] = {"ours": {}, "nemo": {}, "dense": {}}
    with tempfile.TemporaryDirectory() as tmp:
        weights = Path(tmp) / "weights.pt"
        made = run_child(a, "weights", "--weights", weights, nemo=True)
        print(f"weights: {made['parameters']:,} parameters, vocab {made['vocab']}", flush=True)
        for impl, seq in cases:  # interleaved: ours, NeMo(, dense) per length
            r = run_child(a, impl, "--seq", seq, "--weights", weights, nemo=impl == "nemo")
            results[impl][seq] = r
            if "stopped" in r:
                line = f"stopped above {a.rss_limit_gib} GiB in {r['stopped']}"
            else:
                line = (f"{r['median_s']:.2f} s/step ({r['median_cpu_s']:.2f} CPU s), peak "
                        f"{gib(r['peak'])} GiB, loss {r['loss']:.7f}")
            print(f"  {impl:5s} {seq:6d}: {line}", flush=True)
    header = ("seq", "ours s/step", "ours peak GiB", "NeMo s/step", "NeMo peak GiB",
              "dense s/step", "dense peak GiB", "loss ours", "loss NeMo", "|diff|")
    print(" | ".join(header))

    def cell(impl, seq, key):
        r = results[impl].get(seq)
        if r is None:
            return "-"
        if "stopped" in r:
            return f">{a.rss_limit_gib:g} GiB"
        return f"{r[key]:.2f}" if key == "median_s" else gib(r[key])

    for seq in a.lengths:
        ours, nemo = results["ours"][seq], results["nemo"].get(seq)
        diff = abs(ours["loss"] - nemo["loss"]) if nemo and "loss" in nemo else None
        print(" | ".join([str(seq), cell("ours", seq, "median_s"), cell("ours", seq, "peak"),
                          cell("nemo", seq, "median_s"), cell("nemo", seq, "peak"),
                          cell("dense", seq, "median_s"), cell("dense", seq, "peak"),
                          f"{ours['loss']:.7f}", f"{nemo['loss']:.7f}" if nemo else "-",
                          f"{diff:.1e}" if diff is not None else "-"]))
    ratios = {}
    for short, long in zip(a.lengths, a.lengths[1:]):
        o = results["ours"]
        ratios[f"ours_{long}_over_{short}"] = {
            "time": o[long]["median_s"] / o[short]["median_s"],
            "cpu": o[long]["median_cpu_s"] / o[short]["median_cpu_s"],
            "peak": o[long]["peak"] / o[short]["peak"]}
    for seq in a.nemo_lengths:
        if seq in results["ours"] and "median_s" in results["nemo"].get(seq, {}):
            o, n = results["ours"][seq], results["nemo"][seq]
            ratios[f"ours_over_nemo_{seq}"] = {"time": o["median_s"] / n["median_s"],
                                               "cpu": o["median_cpu_s"] / n["median_cpu_s"],
                                               "peak": o["peak"] / n["peak"]}
    for name, r in ratios.items():
        print(f"{name}: time {r['time']:.3f} (CPU time {r['cpu']:.3f}), peak {r['peak']:.3f}")
    out = a.out or RESULTS / "bench_v41_long.json"
    write_result(out, {"fields": LONG_FIELDS, "engram": False,
                       "fake_quantize": not a.no_fake_quantize, "dtype": "float32", "batch": 1,
                       "steps": a.steps, "parameters": made["parameters"], "vocab": made["vocab"],
                       "results": {k: {str(s): r for s, r in v.items()}
                                   for k, v in results.items()},
                       "ratios": ratios})


def main_real(a) -> None:
    results = {}
    for case in a.real_cases:
        r = run_child(a, "real", "--case", case, "--seq", a.real_seq)
        results[case] = r
        if "stopped" in r:
            print(f"{case}: stopped above {a.rss_limit_gib} GiB in {r['stopped']} "
                  f"(peaks {[(k, gib(v)) for k, v in r['peaks'].items()]})", flush=True)
            continue
        print(f"{case} (layer {r['layer_id']}, {r['kind']} at ratio {r['ratio']}): forward "
              f"{r['forward_s']:.1f} s, backward {r['backward_s']:.1f} s, peak {gib(r['peak'])} "
              f"GiB (built {gib(r['rss_built'])}, after forward {gib(r['rss_after_forward'])}, "
              f"saved for backward {gib(r['saved_bytes'])}; phases "
              f"{ {k: gib(v) for k, v in r['phase_peaks'].items()} })", flush=True)
        for nbytes, shape, dtype in r["saved_largest"]:
            print(f"    saved {nbytes / 2**20:9.1f} MiB {shape} {dtype}")
    out = a.out or RESULTS / "bench_v41_long_real_shape.json"
    write_result(out, {"seq": a.real_seq, "dtype": "float32", "batch": 1, "results": results})


def main_tiny(a) -> None:
    """The trainer at `tiny_seq` tokens, one process, 3 steps; peak RSS of its worker."""
    with tempfile.TemporaryDirectory() as tmp:
        exp = Path(tmp) / "run"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1",
               f"--master-port={free_port()}", "-m", "engram_train.train",
               "model=deepseek_v41_tiny",
               f"experiment.exp_dir={exp}", f"train.seq_length={a.tiny_seq}",
               "train.micro_batch_size=1", "train.global_batch_size=1", "train.train_iters=3",
               "train.log_interval=1", "train.eval_interval=null", "train.lr_warmup_iters=1",
               "system.memory_check=warn"]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        start = time.perf_counter()
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - start
        if proc.returncode:
            raise SystemExit(proc.stdout[-3000:] + proc.stderr[-6000:])
        records = [json.loads(line) for line in (exp / "metrics.jsonl").read_text().splitlines()
                   if line.strip()]
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # the worker's
    warning = [line for line in proc.stdout.splitlines() + proc.stderr.splitlines()
               if "memory check" in line]
    for r in records:
        print(f"step {r['iteration']}: loss {r['lm_loss']:.4f}, {r['step_time_s']:.1f} s")
    print(f"peak RSS {gib(peak)} GiB, wall {wall:.0f} s")
    out = a.out or RESULTS / "bench_v41_long_tiny32k.json"
    write_result(out, {"seq": a.tiny_seq, "command": cmd[1:], "records": records,
                       "peak": peak, "wall_s": wall, "memory_check": warning})


def main(argv=None) -> None:
    a = parse_args(argv)
    if a.threads:
        import torch

        torch.set_num_threads(a.threads)
    if a.child == "weights":
        return child_weights(a)
    if a.child in ("ours", "dense"):
        return child_ours(a, "dense" if a.child == "dense" else "sparse")
    if a.child == "nemo":
        return child_nemo(a)
    if a.child == "real":
        return child_real(a)
    if a.real_shape:
        return main_real(a)
    if a.tiny_32k:
        return main_tiny(a)
    return main_linear(a)


if __name__ == "__main__":
    main()
