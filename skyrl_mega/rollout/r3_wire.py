"""Routed experts (R3) on the wire and in memory: decode vLLM's routes, map layers, align, encode.

What vLLM 0.30.0 sends (`--enable-return-routed-experts`, read from
vllm/entrypoints/scale_out/token_in_token_out/serving.py and
vllm/model_executor/layers/fused_moe/routed_experts_capturer.py): every choice of
/inference/v1/generate (and of /v1/completions) carries `routed_experts`, the base64 of an
`.npy` file (`np.save(..., allow_pickle=False)`, so the dtype and shape are in its header),
or null when the request was aborted before any forward pass.

Shape convention, engine side: `[prompt_len + num_generated - 1, num_hidden_layers, top_k]`.
    row t      = the token at position t of prompt+response; every prompt token and every
                 generated token except the LAST one (the last sampled token is never fed
                 back through the model, so it has no route);
    column l   = GLOBAL decoder layer l; vLLM reports ALL layers and a non-MoE (dense) layer
                 holds 0, which looks like expert 0: select MoE columns by layer number.
                 Another engine may report MoE layers only: `select_moe_layers` takes both;
    entry      = expert ids in the router's top-k order (descending routing weight);
    dtype      = vLLM narrows by expert count (uint8 up to 256 experts).

Shape convention, project side (the DESIGN's wire format): `[tokens, moe_layers, top_k]`,
uint8 when experts <= 256, else int16; travels as JSON `{"dtype", "shape", "data"}` with
`data` the base64 of the C-order little-endian bytes. Never pickle.
`align_to_sequence` pads the missing last row so that rows match prompt+response tokens
one to one, with a mask saying which rows are real routes.
"""

from __future__ import annotations

import base64
import binascii
import io
from typing import Any, Mapping, Sequence

import numpy as np

_WIRE_DTYPES = {"uint8": np.dtype("uint8"), "int16": np.dtype("<i2")}


class R3FormatError(ValueError):
    """Routed experts that cannot be decoded, or whose shape does not fit the tokens/layers."""


def expert_dtype(num_experts: int) -> np.dtype:
    """uint8 when experts <= 256, int16 up to 32768 experts."""
    if num_experts <= 0:
        raise ValueError(f"num_experts must be positive, got {num_experts}")
    if num_experts <= 256:
        return np.dtype("uint8")
    if num_experts <= 32768:
        return np.dtype("<i2")
    raise ValueError(f"{num_experts} experts do not fit int16 expert ids")


def compact(routes: np.ndarray, num_experts: int) -> np.ndarray:
    """Casts expert ids to the storage dtype after checking 0 <= id < num_experts."""
    routes = np.asarray(routes)
    if routes.size and (routes.min() < 0 or routes.max() >= num_experts):
        raise R3FormatError(
            f"expert ids out of range [0, {num_experts}): min {routes.min()}, max {routes.max()}"
        )
    return routes.astype(expert_dtype(num_experts), copy=False)


# -- vLLM's format ----------------------------------------------------------------------------
def decode_vllm(b64_npy: str) -> np.ndarray:
    """vLLM's `routed_experts` (base64 of .npy) -> int array [rows, layers, top_k]."""
    if not isinstance(b64_npy, str):
        raise R3FormatError(f"routed_experts must be a base64 string, got {type(b64_npy).__name__}")
    try:
        raw = base64.b64decode(b64_npy, validate=True)
        arr = np.load(io.BytesIO(raw), allow_pickle=False)
    except (binascii.Error, ValueError, OSError, EOFError) as e:
        raise R3FormatError(f"routed_experts is not base64 .npy data: {e}") from e
    if not isinstance(arr, np.ndarray) or arr.ndim != 3:
        raise R3FormatError(f"routed_experts must be 3-D [tokens, layers, top_k], got shape {getattr(arr, 'shape', None)}")
    if arr.dtype.kind not in "iu":
        raise R3FormatError(f"routed_experts must hold integers, got dtype {arr.dtype}")
    return arr


def encode_vllm(routes: np.ndarray) -> str:
    """The inverse of decode_vllm (tests and fake servers use it)."""
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(routes), allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode("ascii")


# -- the project's wire format ----------------------------------------------------------------
def encode(routes: np.ndarray, num_experts: int) -> dict[str, Any]:
    """[tokens, moe_layers, top_k] ids -> JSON-able {"dtype", "shape", "data"} (base64, explicit dtype)."""
    routes = np.asarray(routes)
    if routes.ndim != 3:
        raise R3FormatError(f"routes must be 3-D [tokens, moe_layers, top_k], got shape {routes.shape}")
    arr = np.ascontiguousarray(compact(routes, num_experts))
    name = "uint8" if arr.dtype == np.uint8 else "int16"
    return {
        "dtype": name,
        "shape": [int(x) for x in arr.shape],
        "data": base64.b64encode(arr.astype(_WIRE_DTYPES[name], copy=False).tobytes()).decode("ascii"),
    }


def decode(obj: Mapping[str, Any] | str) -> np.ndarray:
    """The project's dict format (or vLLM's base64 .npy string) -> int array."""
    if isinstance(obj, str):
        return decode_vllm(obj)
    if not isinstance(obj, Mapping):
        raise R3FormatError(f"expected a dict or a base64 string, got {type(obj).__name__}")
    try:
        name, shape, data = obj["dtype"], obj["shape"], obj["data"]
    except KeyError as e:
        raise R3FormatError(f"routes dict lacks {e}") from e
    if name not in _WIRE_DTYPES:
        raise R3FormatError(f"unknown routes dtype {name!r}; expected one of {sorted(_WIRE_DTYPES)}")
    if not (isinstance(shape, (list, tuple)) and len(shape) == 3 and all(isinstance(x, int) and x >= 0 for x in shape)):
        raise R3FormatError(f"routes shape must be 3 non-negative ints, got {shape!r}")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, TypeError, ValueError) as e:
        raise R3FormatError(f"routes data is not base64: {e}") from e
    dt = _WIRE_DTYPES[name]
    if len(raw) != int(np.prod(shape)) * dt.itemsize:
        raise R3FormatError(f"routes data has {len(raw)} bytes; shape {shape} of {name} needs {int(np.prod(shape)) * dt.itemsize}")
    return np.frombuffer(raw, dtype=dt).reshape(shape).astype(dt.newbyteorder("="), copy=True)


# -- layers ------------------------------------------------------------------------------------
def moe_layer_ids(hf_config: Mapping[str, Any] | Any) -> list[int]:
    """Global indices of the MoE decoder layers of an HF config (dict or config object).

    Qwen3-MoE / Qwen2-MoE: layers not in `mlp_only_layers` whose (i+1) % decoder_sparse_step == 0.
    NemotronH: `layers_block_type` (or `hybrid_override_pattern` 'E') entries equal to "moe".
    Otherwise, with `first_k_dense_replace` (DeepSeek style) layers >= k, else every layer.
    """
    get = (lambda k, d=None: hf_config.get(k, d)) if isinstance(hf_config, Mapping) else (
        lambda k, d=None: getattr(hf_config, k, d)
    )
    if get("text_config") is not None and get("num_hidden_layers") is None:
        return moe_layer_ids(get("text_config"))
    n = get("num_hidden_layers")
    kinds = get("layers_block_type")
    if kinds is not None and not isinstance(kinds, str):
        return [i for i, k in enumerate(kinds) if str(k).lower() == "moe"]
    pattern = get("hybrid_override_pattern")
    if isinstance(pattern, str):
        return [i for i, c in enumerate(pattern) if c == "E"]
    if n is None:
        raise ValueError("config has no num_hidden_layers")
    if get("mlp_only_layers") is not None or get("decoder_sparse_step") is not None:
        dense = set(get("mlp_only_layers") or [])
        step = int(get("decoder_sparse_step") or 1)
        n_exp = get("num_experts") or get("num_local_experts") or 0
        if n_exp <= 0:
            return []
        return [i for i in range(n) if i not in dense and (i + 1) % step == 0]
    k = get("first_k_dense_replace")
    if k is not None:
        return list(range(int(k), n))
    return list(range(n))


def select_moe_layers(
    routes: np.ndarray, moe_layers: Sequence[int], num_hidden_layers: int | None = None
) -> np.ndarray:
    """[rows, reported_layers, k] -> [rows, len(moe_layers), k].

    The engine may report all layers (vLLM) or MoE layers only; both map here:
    - reported == len(moe_layers): already MoE-only (or every layer is MoE): returned as is;
    - reported  > max(moe_layers): all layers: the MoE columns are taken by global number.
    """
    routes = np.asarray(routes)
    if routes.ndim != 3:
        raise R3FormatError(f"routes must be 3-D [tokens, layers, top_k], got shape {routes.shape}")
    moe_layers = [int(i) for i in moe_layers]
    if not moe_layers:
        raise ValueError("moe_layers is empty")
    if sorted(set(moe_layers)) != moe_layers:
        raise ValueError(f"moe_layers must be strictly increasing, got {moe_layers}")
    reported = routes.shape[1]
    if num_hidden_layers is not None and reported not in (num_hidden_layers, len(moe_layers)):
        raise R3FormatError(
            f"engine reported {reported} layers; expected all {num_hidden_layers} or the "
            f"{len(moe_layers)} MoE layers"
        )
    if reported == len(moe_layers):
        return routes
    if reported > moe_layers[-1]:
        return routes[:, moe_layers, :]
    raise R3FormatError(
        f"engine reported {reported} layers; cannot hold MoE layers {moe_layers} "
        f"(neither all layers nor MoE layers only)"
    )


def expand_to_all_layers(
    moe_routes: np.ndarray, moe_layers: Sequence[int], num_hidden_layers: int, fill: int = 0
) -> np.ndarray:
    """[rows, len(moe_layers), k] -> [rows, num_hidden_layers, k]; dense layers hold `fill`."""
    moe_routes = np.asarray(moe_routes)
    if moe_routes.ndim != 3 or moe_routes.shape[1] != len(moe_layers):
        raise R3FormatError(f"expected [rows, {len(moe_layers)}, k], got {moe_routes.shape}")
    out = np.full((moe_routes.shape[0], num_hidden_layers, moe_routes.shape[2]), fill, dtype=moe_routes.dtype)
    out[:, list(moe_layers), :] = moe_routes
    return out


# -- tokens ------------------------------------------------------------------------------------
def align_to_sequence(routes: np.ndarray, prompt_len: int, response_len: int, fill: int = 0):
    """Rows for exactly prompt+response tokens: returns (routes [P+R, L, k], valid [P+R] bool).

    vLLM gives P+R-1 rows (the last sampled token has no route): that row is added with
    `fill` and valid=False, so the trainer lets its own router pick for that one token
    (it only affects logits after the last token, which no loss reads). P+R rows (an
    engine that also routes the last token) are returned as they are, all valid.
    """
    routes = np.asarray(routes)
    total = prompt_len + response_len
    if routes.ndim != 3:
        raise R3FormatError(f"routes must be 3-D, got shape {routes.shape}")
    if routes.shape[0] == total:
        return routes, np.ones(total, dtype=bool)
    if routes.shape[0] != total - 1:
        raise R3FormatError(
            f"routes have {routes.shape[0]} rows; prompt {prompt_len} + response {response_len} "
            f"tokens need {total - 1} (vLLM) or {total}"
        )
    pad = np.full((1,) + routes.shape[1:], fill, dtype=routes.dtype)
    valid = np.ones(total, dtype=bool)
    valid[-1] = False
    return np.concatenate([routes, pad], axis=0), valid
