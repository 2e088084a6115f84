"""Peak memory of vocab-parallel logprobs + entropy, forward+backward: one chunk vs token chunks.

What it runs: `skyrl_mega.megatron.logprobs.vocab_parallel_logprobs` on random logits
[--tokens, --vocab] of --dtype (bf16 by default, as megatron's output layer gives them on GPU),
single rank (TP=1), temperature 0.9, with the entropy and its gradient (the training path with
entropy_coef != 0: the largest backward), then torch.autograd.grad of sum(w1 * logprob +
w2 * entropy) w.r.t. the logits. One variant per --chunks entry:

  plain     chunk_tokens=0: one chunk of all tokens (fp32 [tokens, V] working tensors)
  auto      chunk_tokens="auto" (the default: an fp32 chunk slab <= AUTO_CHUNK_BYTES)
  N         chunk_tokens=N
  before    optional (--baseline-file / --baseline-rev): the same call through another copy of
            logprobs.py, e.g. the pre-chunking implementation (`--baseline-rev e8f8fbb`), which
            kept the fp32 softmax and scaled logits for backward

Reported per variant: peak bytes above the inputs (logits, labels, weights; the bf16 gradient
the backward returns counts in the peak: any implementation must produce it) and the median
time of forward+backward.

How the peak is measured:
  cuda  torch.cuda.max_memory_allocated after reset_peak_memory_stats, minus
        memory_allocated with only the inputs alive; variants run in one process, one after the
        other, after one warm-up each; an out-of-memory variant is reported as OOM.
  cpu   each variant in a fresh subprocess of this script: the inputs are built in row blocks
        (no full-size temporary), then peak = ru_maxrss after one forward+backward minus the
        resident set (/proc/self/statm) just before it. Large CPU tensors are mmap'ed by glibc
        and returned on free, so this is the tensors' high-water mark plus allocator slack.
        One warm-up on a tiny input first (imports, thread pools), then one timed run (CPU times
        are only indicative).

Examples:
    python bench/logprob_memory.py --device cpu --tokens 4096 --chunks plain,auto,1024
    python3 bench/logprob_memory.py --device cuda --tokens 16384 --chunks plain,auto,1024,4096 \
        --baseline-rev e8f8fbb --out logprob_memory.json
Prints the command used, a table, and writes JSON with --out.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import torch  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
          "float32": torch.float32, "fp32": torch.float32}
TEMPERATURE = 0.9


def _module(args):
    if args.variant == "before":
        spec = importlib.util.spec_from_file_location("logprobs_before", args.baseline_file)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    from skyrl_mega.megatron import logprobs

    return logprobs


def _chunk_kw(variant):
    if variant == "before":
        return {}
    if variant == "plain":
        return {"chunk_tokens": 0}
    if variant == "auto":
        return {"chunk_tokens": "auto"}
    return {"chunk_tokens": int(variant)}


def _inputs(args, dev):
    n, v = args.tokens, args.vocab
    dtype = DTYPES[args.dtype]
    g = torch.Generator(device=dev).manual_seed(0)
    logits = torch.empty(n, v, dtype=dtype, device=dev)
    block = max(1, (64 << 20) // (4 * v))  # row blocks: no full-size fp32 temporary
    for a in range(0, n, block):
        b = min(n, a + block)
        logits[a:b] = torch.randn(b - a, v, generator=g, device=dev) * 2
    labels = torch.randint(0, args.valid_vocab or v, (n,), generator=g, device=dev)
    w1 = torch.randn(n, generator=g, device=dev)
    w2 = torch.randn(n, generator=g, device=dev) * 0.01
    return logits, labels, w1, w2


def _step(fn, kw, logits, labels, w1, w2, args):
    x = logits.requires_grad_()
    lp, ent = fn(x, labels, TEMPERATURE, with_entropy=True, entropy_grad=not args.no_entropy_grad,
                 vocab_size=args.valid_vocab, **kw)
    loss = (lp * w1).sum() + ((ent * w2).sum() if not args.no_entropy_grad else 0.0)
    (grad,) = torch.autograd.grad(loss, x)
    return lp.detach(), ent.detach(), grad


def _checksum(lp, ent, grad):
    """(sum of logprob + entropy, sum |grad|), in row blocks: no full-size temporary."""
    block = max(1, (64 << 20) // (8 * grad.shape[-1]))
    g = sum(float(grad[a:a + block].double().abs().sum()) for a in range(0, grad.shape[0], block))
    return float(lp.double().sum() + ent.double().sum()), g


def _rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run_cpu_child(args):
    """One variant in this (fresh) process; prints one JSON line."""
    torch.set_num_threads(args.threads or torch.get_num_threads())
    fn = _module(args).vocab_parallel_logprobs
    # warm-up on a tiny input: imports (the TP-group lookup tries megatron) and thread pools stay
    # out of the measured window
    _step(fn, _chunk_kw(args.variant), torch.randn(8, 64, dtype=DTYPES[args.dtype]), torch.zeros(8, dtype=torch.long),
          torch.ones(8), torch.ones(8), argparse.Namespace(no_entropy_grad=args.no_entropy_grad, valid_vocab=None))
    logits, labels, w1, w2 = _inputs(args, "cpu")
    rss0 = _rss_bytes()
    max0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    t = time.perf_counter()
    res = _step(fn, _chunk_kw(args.variant), logits, labels, w1, w2, args)
    dt = time.perf_counter() - t
    max1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    checksum = _checksum(*res)
    print(json.dumps({"variant": args.variant, "peak_above_inputs": max1 - rss0, "time_s": [dt],
                      "rss_before": rss0, "maxrss_before": max0, "maxrss_after": max1, "checksum": checksum}))


def run_cpu(args, variants):
    out = []
    for v in variants:
        cmd = [sys.executable, os.path.abspath(__file__), "--_child", "--variant", v, *_child_args(args)]
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode != 0:
            died = "killed (out of memory?)" if p.returncode in (-9, 137) else f"exit {p.returncode}"
            print(f"[{v}] {died}: {p.stderr.strip()[-400:]}", file=sys.stderr)
            out.append({"variant": v, "error": died})
            continue
        r = json.loads(p.stdout.strip().splitlines()[-1])
        if r["maxrss_before"] > r["rss_before"] + (256 << 20):
            r["warning"] = "high-water mark before the step exceeded the resident set: peak understated"
        out.append(r)
    return out


def run_cuda(args, variants):
    dev = torch.device("cuda")
    out = []
    for v in variants:
        args.variant = v
        fn = _module(args).vocab_parallel_logprobs
        kw = _chunk_kw(v)
        logits, labels, w1, w2 = _inputs(args, dev)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        r = {"variant": v}
        try:
            res = _step(fn, kw, logits, labels, w1, w2, args)  # warm-up
            del res
            torch.cuda.synchronize()
            times, peaks = [], []
            for _ in range(args.repeat):
                torch.cuda.reset_peak_memory_stats()
                t = time.perf_counter()
                res = _step(fn, kw, logits, labels, w1, w2, args)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t)
                peaks.append(torch.cuda.max_memory_allocated() - base)
                checksum = _checksum(*res)
                del res
            r.update(peak_above_inputs=max(peaks), time_s=times, checksum=checksum, inputs_bytes=base)
        except torch.cuda.OutOfMemoryError as e:
            r["error"] = "OOM: " + str(e).splitlines()[0][:200]
        del logits, labels, w1, w2
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        out.append(r)
    return out


def _child_args(args):
    a = ["--device", "cpu", "--tokens", str(args.tokens), "--vocab", str(args.vocab), "--dtype", args.dtype]
    if args.valid_vocab:
        a += ["--valid-vocab", str(args.valid_vocab)]
    if args.no_entropy_grad:
        a += ["--no-entropy-grad"]
    if args.baseline_file:
        a += ["--baseline-file", args.baseline_file]
    if args.threads:
        a += ["--threads", str(args.threads)]
    return a


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tokens", type=int, default=16384, help="tokens in the micro-batch (default 16384)")
    ap.add_argument("--vocab", type=int, default=248320,
                    help="logits' last dim (default 248320: Qwen3.5's padded vocab)")
    ap.add_argument("--valid-vocab", type=int, default=None, help="vocab_size (ids >= it are padding); default none")
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    ap.add_argument("--chunks", default="plain,auto,256,4096",
                    help="comma list of variants: plain (chunk 0), auto, or a token count")
    ap.add_argument("--baseline-file", default=None, help="another logprobs.py to run as variant 'before'")
    ap.add_argument("--baseline-rev", default=None, help="git revision whose logprobs.py is variant 'before'")
    ap.add_argument("--no-entropy-grad", action="store_true", help="entropy as a metric (entropy_grad=False)")
    ap.add_argument("--repeat", type=int, default=3, help="timed repeats on CUDA (CPU: one run)")
    ap.add_argument("--threads", type=int, default=0, help="CPU threads (default torch's)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--_child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--variant", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args._child:
        return run_cpu_child(args)

    variants = [c.strip() for c in args.chunks.split(",") if c.strip()]
    if args.baseline_rev:
        src = subprocess.run(["git", "-C", REPO, "show", f"{args.baseline_rev}:skyrl_mega/megatron/logprobs.py"],
                             check=True, capture_output=True, text=True).stdout
        f = tempfile.NamedTemporaryFile("w", suffix="_logprobs_before.py", delete=False)
        f.write(src)
        f.close()
        args.baseline_file = f.name
    if args.baseline_file:
        variants.insert(0, "before")
    cmd = "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(__file__, REPO), *(argv or sys.argv[1:])])
    print("command:", cmd)

    from skyrl_mega.megatron.logprobs import AUTO_CHUNK_BYTES, chunk_size

    auto = chunk_size("auto", args.tokens, args.vocab)
    itemsize = torch.empty((), dtype=DTYPES[args.dtype]).element_size()
    if args.device == "cuda":
        hw = torch.cuda.get_device_name()
        results = run_cuda(args, variants)
    else:
        hw = f"CPU {platform.processor() or platform.machine()}, {os.cpu_count()} cores"
        results = run_cpu(args, variants)
    gib = 1 << 30
    fp32_full = 4 * args.tokens * args.vocab
    print(f"{hw}; torch {torch.__version__}; tokens {args.tokens}, vocab {args.vocab}, {args.dtype}; "
          f"auto chunk = {auto} tokens (AUTO_CHUNK_BYTES {AUTO_CHUNK_BYTES >> 20} MiB); "
          f"logits {itemsize * args.tokens * args.vocab / gib:.2f} GiB, one fp32 [tokens, V] "
          f"{fp32_full / gib:.2f} GiB")
    print(f"{'variant':>8} {'peak above inputs':>20} {'x fp32 [T,V]':>13} {'time':>10}")
    for r in results:
        if "error" in r:
            print(f"{r['variant']:>8} {r['error'][:60]:>20}")
            continue
        t = statistics.median(r["time_s"])
        peak = r["peak_above_inputs"]
        print(f"{r['variant']:>8} {peak / gib:>16.2f} GiB {peak / fp32_full:>13.2f} {t:>9.3f}s"
              + (f"  ({r['warning']})" if "warning" in r else ""))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": cmd, "hardware": hw, "torch": torch.__version__, "tokens": args.tokens,
                       "vocab": args.vocab, "dtype": args.dtype, "auto_chunk_tokens": auto,
                       "entropy_grad": not args.no_entropy_grad, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
