"""Memory per GPU of a run: the table `skyrl-mega validate` prints, the check that refuses a
layout that cannot fit, and the arithmetic of the large recipes' headers (tests/test_memory.py
holds each header equal to this table: there is no second copy of the formula).

In:  the model's HF config as config.json holds it (a dict; the text model of a multimodal
     checkpoint; Nemotron's layers from `hybrid_override_pattern` or `layers_block_type`), a
     SkyrlConfig and the world size. Out: a `MemoryEstimate` of the most loaded GPU: its rows
     (item, bytes, how), the phases they add up to, the peak and the largest item in it;
     `table()` renders it (GiB, one decimal), `problem()` says in one line why it exceeds
     parallel.gpu_memory_gib, naming the largest item and what shrinks it.

Parameters are counted per layer kind from the shapes; the count equals transformers' model
(its multi-token-prediction layers and vision tower are not built here, so not counted).
Per GPU, of its pipeline stage's layers (embeddings on the first stage, the output layer on
the last; every stage is computed and the most loaded one reported):
- weights in model.dtype; gradients in fp32 (megatron's grad buffers, grad_reduce_in_fp32);
  Adam state: two fp32 moments, plus an fp32 master copy of bf16 weights. Routed experts are
  split over ep x etp, the rest over tp (norms and routers, replicated in truth, are small).
  The distributed optimizer shards its state over the data-parallel ranks: world / (tp pp) for
  the dense part, the expert-data-parallel world / (etp ep pp) for the experts.
- activations: values kept for backward, per token and layer, counted as Korthikanti et al.
  (2022) count them (the inputs of every matmul, norm and nonlinearity; flash attention keeps
  no score matrix; no dropout), for h hidden, q = heads x head_dim, kv = kv_heads x head_dim:
    attention       2h + 2q + 2kv  (+ 2q for an output gate, + q + kv for q/k norms)
    Gated DeltaNet  2h + 4K + 6V + 2nv   (K / V key / value widths, nv value heads)
    Mamba2          2h + 5D + 4G + nh    (D = heads x head_dim, G = groups x state, nh heads)
    dense MLP       2h + (g+1) f         (g = 2 for a gated MLP (SwiGLU), 1 otherwise)
    MoE             2h + k (2h + (g+1) f) + (g+1) s  (k routed copies of each token: permuted
                    input, fc1 and activation outputs, fc2 output; s the shared expert's width)
  A plain GPT layer gives 32h bytes in bf16 (the paper: 34h, counting dropout masks). Times
  the micro-batch's tokens / (tp cp) (sequence parallel splits what TP does not), in
  model.dtype; routing assumed balanced. The first stage holds pp micro-batches in flight
  (1F1B). train.recompute_granularity=full keeps each layer's input (h) and one layer's values.
- logits: the output layer's [tokens, vocab / tp] in model.dtype and their gradient, plus two
  fp32 chunks of megatron/logprobs.py (at most AUTO_CHUNK_BYTES each).
- engine (rollout.*): every parameter in rollout.dtype (auto: the checkpoint's) / engine_tp,
  and the KV cache: kv_cache_gib, or what gpu_memory_utilization leaves after the weights.
Tokens per micro-batch: train.max_tokens_per_microbatch when packing, else micro_batch_size
rows of data.max_prompt_len + rollout.max_tokens.

Phases (controller/placement.py): colocated engines sleep while the trainer trains (their
weights leave the GPU, the KV cache is freed) and the trainer keeps its state throughout:
  train    weights + gradients + optimizer state (+ reference weights) + activations + logits
  rollout  weights + gradients + optimizer state (+ reference weights) + engine weights + KV
           cache (the weight sync, engine weights awake and KV cache not yet, needs less)
Disaggregated engines have GPUs of their own: `engine GPU` = engine weights + KV cache.
The peak is the largest phase. Not counted: the CUDA context, NCCL buffers, the allocator's
fragmentation, the weight sync's buckets, the optimizer step's temporaries: the check refuses
only a peak over parallel.gpu_memory_gib, so keep headroom. The one run to compare with
(BENCHMARKS.md, qwen3_moe/1b_gpu, micro-batches well under its 8192-token budget) measured the
trainer's peak at 24.8 GiB training, where this says 22.2 at the full budget, and 18.7 GiB plus
the engine's 9.8 at rollout, where this says 27.2: a floor, a few GiB low.
The check runs on CPU boxes too (a recipe is checked for the GPUs it names; the tiny CPU
recipes need a GiB or two); parallel.gpu_memory_gib=null turns it off.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Optional

from .validate import num_experts

GIB = float(1 << 30)
DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}
FAMILIES = ("qwen3_moe", "qwen3_5_moe", "qwen3_5_moe_text", "nemotron_h")  # HF model_type
ENGINE_GPU = "engine GPU"  # the phase of a disaggregated engine's GPU
# what shrinks each item (the refusal names the largest one)
REMEDIES = {
    "weights": "spread the model wider (parallel.ep for experts, tp / pp) or use more GPUs",
    "gradients": "spread the model wider (parallel.ep for experts, tp / pp) or use more GPUs",
    "optimizer state": "spread it wider (parallel.ep for experts, tp / pp, more GPUs: the distributed "
                       "optimizer shards it over the data-parallel ranks)",
    "reference weights": "set algorithm.use_reference=false or spread the model wider",
    "activations": "lower train.max_tokens_per_microbatch, set train.recompute_granularity=full, or raise "
                   "parallel.tp / cp",
    "logits": "lower train.max_tokens_per_microbatch or raise parallel.tp",
    "engine weights": "raise rollout.engine_tp",
    "engine KV cache": "lower rollout.kv_cache_gib (or rollout.gpu_memory_utilization)",
}


@dataclass(frozen=True)
class Layer:
    """One decoder layer (or a part of one): parameters outside / inside the routed experts,
    and the values per token it keeps for backward."""

    dense: int = 0
    experts: int = 0
    act: int = 0

    def __add__(self, other: "Layer") -> "Layer":
        return Layer(self.dense + other.dense, self.experts + other.experts, self.act + other.act)


@dataclass(frozen=True)
class ModelShape:
    layers: list[Layer]
    embed: int  # input embeddings
    head: int  # output layer + final norm (the last stage's)
    hidden: int
    vocab: int

    @property
    def total(self) -> int:
        return self.experts + self.dense

    @property
    def experts(self) -> int:
        return sum(la.experts for la in self.layers)

    @property
    def dense(self) -> int:
        return self.embed + self.head + sum(la.dense for la in self.layers)


# ------------------------------------------------------------------ layer kinds (HF shapes)
def _attention(h: int, hf: dict, gated: bool, qk_norm: bool) -> Layer:
    heads, kv_heads = hf["num_attention_heads"], hf.get("num_key_value_heads") or hf["num_attention_heads"]
    hd = hf.get("head_dim") or h // heads
    q, kv = heads * hd, kv_heads * hd
    bias = (q * (2 if gated else 1) + 2 * kv + h) if hf.get("attention_bias") else 0
    params = h * q * (2 if gated else 1) + 2 * h * kv + q * h + bias + (2 * hd if qk_norm else 0)
    act = 2 * h + 2 * q + 2 * kv + (2 * q if gated else 0) + (q + kv if qk_norm else 0)
    return Layer(dense=params, act=act)


def _gated_deltanet(h: int, hf: dict) -> Layer:
    nv = hf["linear_num_value_heads"]
    k = hf["linear_num_key_heads"] * hf["linear_key_head_dim"]
    v = nv * hf["linear_value_head_dim"]
    conv = (2 * k + v) * hf.get("linear_conv_kernel_dim", 4)
    params = h * (2 * k + v) + h * v + 2 * h * nv + conv + 2 * nv + hf["linear_value_head_dim"] + v * h
    return Layer(dense=params, act=2 * h + 4 * k + 6 * v + 2 * nv)


def _mamba2(h: int, hf: dict) -> Layer:
    nh = hf["mamba_num_heads"]
    d, g = nh * hf["mamba_head_dim"], hf["n_groups"] * hf["ssm_state_size"]
    conv = (d + 2 * g) * (hf.get("conv_kernel", 4) + (1 if hf.get("use_conv_bias", True) else 0))
    params = h * (2 * d + 2 * g + nh) + conv + 3 * nh + d + d * h
    return Layer(dense=params, act=2 * h + 5 * d + 4 * g + nh)


def _mlp(h: int, ffn: int, gated: bool) -> Layer:
    g = 2 if gated else 1
    return Layer(dense=(g + 1) * h * ffn, act=2 * h + (g + 1) * ffn)


def _moe(h: int, experts: int, topk: int, ffn: int, shared: int, gated: bool, shared_gate: bool) -> Layer:
    g = 2 if gated else 1
    dense = experts * h + (g + 1) * h * shared + (h if shared and shared_gate else 0)
    act = 2 * h + topk * (2 * h + (g + 1) * ffn) + (g + 1) * shared
    return Layer(dense=dense, experts=experts * (g + 1) * h * ffn, act=act)


def _norms(h: int, n: int) -> Layer:
    return Layer(dense=n * h)


# ------------------------------------------------------------------ families
def _qwen3_5_kinds(hf: dict, n: int) -> list[str]:
    """Qwen3.5's layer kinds: `layer_types`, else every `full_attention_interval`-th attention."""
    if hf.get("layer_types"):
        return list(hf["layer_types"])
    every = hf.get("full_attention_interval", 4)
    return ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n)]


def _qwen_layers(hf: dict) -> list[Layer]:
    """Qwen3-MoE (attention + MoE or dense MLP) and Qwen3.5-MoE (Gated DeltaNet or gated
    attention, + MoE with a gated shared expert)."""
    h, n = hf["hidden_size"], hf["num_hidden_layers"]
    qwen35 = hf["model_type"] != "qwen3_moe"
    kinds = _qwen3_5_kinds(hf, n) if qwen35 else ["full_attention"] * n
    shared = hf.get("shared_expert_intermediate_size", 0) if qwen35 else 0
    moe = _moe(h, num_experts(hf), hf["num_experts_per_tok"], hf["moe_intermediate_size"], shared, gated=True,
               shared_gate=True) if num_experts(hf) else None
    step, dense_only = hf.get("decoder_sparse_step", 1) or 1, set(hf.get("mlp_only_layers") or [])
    out = []
    for i, kind in enumerate(kinds[:n]):
        gdn = kind == "linear_attention"
        mixer = _gated_deltanet(h, hf) if gdn else _attention(h, hf, gated=qwen35, qk_norm=True)
        sparse = moe and i not in dense_only and (i + 1) % step == 0
        mlp = moe if sparse else _mlp(h, hf.get("intermediate_size", 0), gated=True)
        out.append(_norms(h, 2) + mixer + mlp)
    return out


def nemotron_pattern(hf: dict) -> str:
    """The layer pattern (M / * / - / E) from either config form (bridges/nemotron_h.py)."""
    from bridges.nemotron_h import layer_pattern

    return layer_pattern(SimpleNamespace(hybrid_override_pattern=hf.get("hybrid_override_pattern"),
                                         layers_block_type=hf.get("layers_block_type")))


def _nemotron_layers(hf: dict) -> list[Layer]:
    h = hf["hidden_size"]
    kinds = {
        "M": lambda: _mamba2(h, hf),
        "*": lambda: _attention(h, hf, gated=False, qk_norm=False),
        "-": lambda: _mlp(h, hf["intermediate_size"], gated=False),
        "E": lambda: _moe(h, num_experts(hf), hf["num_experts_per_tok"], hf["moe_intermediate_size"],
                          hf.get("moe_shared_expert_intermediate_size", 0), gated=False, shared_gate=False),
    }
    return [_norms(h, 1) + kinds[s]() for s in nemotron_pattern(hf)]


def model_shape(hf: dict[str, Any]) -> Optional[ModelShape]:
    """The parameter layout of an HF config of a known family (None for another model type)."""
    if hf.get("model_type") not in FAMILIES:
        return None
    layers = _nemotron_layers(hf) if hf["model_type"] == "nemotron_h" else _qwen_layers(hf)
    h, vocab = hf["hidden_size"], hf["vocab_size"]
    head = h + (0 if hf.get("tie_word_embeddings") else vocab * h)
    return ModelShape(layers=layers, embed=vocab * h, head=head, hidden=h, vocab=vocab)


# ------------------------------------------------------------------ the estimate
@dataclass(frozen=True)
class Row:
    item: str
    bytes: float
    how: str


@dataclass
class MemoryEstimate:
    rows: list[Row]
    phases: dict[str, list[str]]  # "train phase", "rollout phase" or ENGINE_GPU -> the items it holds
    layout: str
    stage: str  # "pipeline stage S of P" when pp > 1, else ""
    params: str
    limit_gib: Optional[float]
    by_item: dict[str, float] = field(init=False)

    def __post_init__(self):
        self.by_item = {r.item: r.bytes for r in self.rows}

    def phase_bytes(self, phase: str) -> float:
        return sum(self.by_item[i] for i in self.phases[phase])

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.phase_bytes)

    @property
    def peak(self) -> float:
        return self.phase_bytes(self.peak_phase)

    @property
    def largest(self) -> Row:
        return max((r for r in self.rows if r.item in self.phases[self.peak_phase]), key=lambda r: r.bytes)

    def fits(self) -> bool:
        return self.limit_gib is None or self.peak <= self.limit_gib * GIB

    def table(self) -> list[str]:
        limit = f"of {self.limit_gib:g} (parallel.gpu_memory_gib)" if self.limit_gib else "(no limit set)"
        where = f", {self.stage} (the most loaded)" if self.stage else ""
        lines = [f"memory per GPU, {self.layout}{where}:", f"  {'parameters':<17} {self.params}"]
        lines += [f"  {r.item:<17} {r.bytes / GIB:6.1f} GiB  {r.how}" for r in self.rows]
        lines += [f"  {p:<17} {self.phase_bytes(p) / GIB:6.1f} GiB  {' + '.join(self.phases[p])}"
                  for p in self.phases]
        lines.append(f"  {'peak':<17} {self.peak / GIB:6.1f} GiB  {limit}: {self.peak_phase}, "
                     f"largest item {self.largest.item}")
        return lines

    def problem(self) -> Optional[str]:
        if self.fits():
            return None
        big, trainer = self.largest, self.peak_phase != ENGINE_GPU
        where = f"{self.peak_phase} of {self.stage}" if self.stage and trainer else self.peak_phase
        return (f"parallel.gpu_memory_gib={self.limit_gib:g}: the run needs {self.peak / GIB:.1f} GiB a GPU "
                f"({where}); the largest item is {big.item}, {big.bytes / GIB:.1f} GiB ({big.how}): "
                f"{REMEDIES[big.item]}")


def _b(n: float) -> str:
    """Parameters: '34.66 B' from a billion up, '0.75 M' below (the tiny models)."""
    return f"{n / 1e9:.2f} B" if n >= 1e9 or n == 0 else f"{n / 1e6:.2f} M"


def tokens_per_microbatch(cfg) -> int:
    t = cfg.train
    if t.packing and t.max_tokens_per_microbatch:
        return t.max_tokens_per_microbatch
    return t.micro_batch_size * (cfg.data.max_prompt_len + cfg.rollout.max_tokens)


def _engine_rows(shape: ModelShape, hf: dict, cfg) -> list[Row]:
    r, limit_gib = cfg.rollout, cfg.parallel.gpu_memory_gib
    dtype = r.dtype if r.dtype != "auto" else (hf.get("dtype") or hf.get("torch_dtype") or cfg.model.dtype)
    weights = shape.total * DTYPE_BYTES.get(str(dtype), 2) / r.engine_tp
    if r.gpu_memory_utilization is not None and limit_gib:
        kv = max(0.0, r.gpu_memory_utilization * limit_gib * GIB - weights)
        kv_how = f"rollout.gpu_memory_utilization={r.gpu_memory_utilization:g} of the GPU, less the weights"
    else:
        kv, kv_how = r.kv_cache_gib * GIB, "rollout.kv_cache_gib"
    return [Row("engine weights", weights, f"{_b(shape.total)} in {dtype} / rollout.engine_tp {r.engine_tp}"),
            Row("engine KV cache", kv, kv_how)]


@dataclass(frozen=True)
class Stage:
    """One pipeline stage's share on one GPU: its layers, its parameters a GPU, its shards."""

    index: int
    layers: list[Layer]
    dense: float  # parameters a GPU outside the routed experts (split over tp)
    experts: float  # routed-expert parameters a GPU (split over ep x etp)
    dp: int  # data-parallel ranks (x cp) sharding the dense optimizer state
    edp: int  # expert-data-parallel ranks sharding the experts' optimizer state
    last: bool


def _stage(shape: ModelShape, p, world: int, index: int) -> Stage:
    etp = p.etp if p.etp is not None else p.tp
    per = len(shape.layers) // p.pp
    first, last = index == 0, index == p.pp - 1
    layers = shape.layers[index * per:None if last else (index + 1) * per]
    dense = sum(la.dense for la in layers) + (shape.embed if first else 0) + (shape.head if last else 0)
    return Stage(index, layers, dense / p.tp, sum(la.experts for la in layers) / (p.ep * etp),
                 dp=world // (p.tp * p.pp), edp=world // (etp * p.ep * p.pp), last=last)


def _state_rows(st: Stage, cfg) -> list[Row]:
    """Weights, fp32 gradients, Adam state (+ the reference model's weights)."""
    dtype, n = cfg.model.dtype, st.dense + st.experts
    wbytes, sharded = DTYPE_BYTES[dtype], cfg.optim.use_distributed_optimizer
    per_param = 12 if wbytes < 4 else 8  # an fp32 master copy (of bf16 weights only) + two fp32 moments
    optimizer = per_param * (st.dense / (st.dp if sharded else 1) + st.experts / (st.edp if sharded else 1))
    rows = [Row("weights", n * wbytes, f"{_b(st.experts)} expert + {_b(st.dense)} dense parameters, {dtype}"),
            Row("gradients", n * 4, "fp32 (grad_reduce_in_fp32)"),
            Row("optimizer state", optimizer, ("fp32 master + " if wbytes < 4 else "") + "2 Adam moments"
                + (f", dense / dp {st.dp}, experts / expert-dp {st.edp}" if sharded else ", not sharded"))]
    if cfg.algorithm.use_reference:
        rows.append(Row("reference weights", n * wbytes, "the reference model, sharded alike"))
    return rows


def _activation_row(st: Stage, shape: ModelShape, cfg) -> Row:
    p, tokens = cfg.parallel, tokens_per_microbatch(cfg)
    in_flight = p.pp - st.index  # 1F1B: stage s holds pp - s micro-batches' activations
    if cfg.train.recompute_granularity == "full":
        per_token = len(st.layers) * shape.hidden * in_flight + max(la.act for la in st.layers)
        how = f"recompute full: {len(st.layers)} layer inputs x {in_flight} in flight + one layer"
    else:
        per_token = sum(la.act for la in st.layers) * in_flight
        how = f"{len(st.layers)} layers x {in_flight} micro-batch(es) in flight"
    return Row("activations", per_token * tokens / (p.tp * p.cp) * DTYPE_BYTES[cfg.model.dtype],
               f"{tokens} tokens / tp {p.tp} / cp {p.cp}, {how}")


def _logits_row(shape: ModelShape, cfg) -> Row:
    from skyrl_mega.megatron.logprobs import AUTO_CHUNK_BYTES

    p, tokens, dtype = cfg.parallel, tokens_per_microbatch(cfg), cfg.model.dtype
    values = tokens / p.cp * shape.vocab / p.tp
    return Row("logits", 2 * values * DTYPE_BYTES[dtype] + 2 * min(AUTO_CHUNK_BYTES, 4 * values),
               f"{tokens} tokens x {shape.vocab} / tp {p.tp}, {dtype} + gradient, fp32 chunks")


def _stage_estimate(shape: ModelShape, hf: dict, cfg, world: int, index: int) -> MemoryEstimate:
    p = cfg.parallel
    st = _stage(shape, p, world, index)
    state = _state_rows(st, cfg)
    train = state + [_activation_row(st, shape, cfg)] + ([_logits_row(shape, cfg)] if st.last else [])
    engine = _engine_rows(shape, hf, cfg)
    phases = {"train phase": [r.item for r in train]}
    if cfg.placement == "colocated":  # the engine sleeps while training; the trainer keeps its state
        phases["rollout phase"] = [r.item for r in state + engine]
    else:  # the engines run on GPUs of their own
        phases[ENGINE_GPU] = [r.item for r in engine]
    etp = p.etp if p.etp is not None else p.tp
    return MemoryEstimate(
        rows=train + engine, phases=phases, limit_gib=p.gpu_memory_gib,
        layout=f"tp={p.tp} pp={p.pp} cp={p.cp} ep={p.ep} etp={etp}, world {world}, {cfg.placement}",
        stage=f"pipeline stage {index + 1} of {p.pp}" if p.pp > 1 else "",
        params=f"{_b(shape.total)} ({_b(shape.experts)} in routed experts, {_b(shape.dense)} dense)")


def estimate(hf: dict[str, Any], cfg, world: int) -> Optional[MemoryEstimate]:
    """The most loaded GPU's memory (its pipeline stage's peak), or None for a model family
    whose shapes are not known here. The layout must be valid (validate.layout_problems)."""
    shape = model_shape(hf)
    if shape is None:
        return None
    stages = [_stage_estimate(shape, hf, cfg, world, s) for s in range(cfg.parallel.pp)]
    return max(stages, key=lambda e: (e.peak, e.phase_bytes("train phase")))


def memory_table(cfg, world: int) -> list[str]:
    """The table for cfg's checkpoint (model.path), or [] when its config is not readable or of
    another family: what `skyrl-mega validate` prints below "config OK"."""
    from .validate import read_hf_config

    hf = read_hf_config(cfg.model.path)
    est = estimate(hf, cfg, world) if hf is not None else None
    return est.table() if est is not None else []
