"""What ``Step.attend`` accepts: the checks of a layer's q, k, v and sinks before anything is sent or written.

Pure functions of the service config and the step's state (no Ray, no gateway): each rejection is an
InvalidRequestError naming the argument, what it got and what to pass instead, and changes nothing.
"""

from __future__ import annotations

import torch

from cpattn.config import ServiceConfig
from cpattn.errors import InvalidRequestError


def check_layer(cfg: ServiceConfig, layer, attended: set[int], in_order: bool) -> None:
    """``layer`` is one this step may attend now (each once; in order 0, 1, ... when ``in_order``)."""
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < cfg.num_layers:
        raise InvalidRequestError(f"layer {layer!r} out of range: use an int in 0..{cfg.num_layers - 1}")
    if layer in attended:
        raise InvalidRequestError(f"layer {layer} was already attended in this step: each layer once per step")
    if in_order and layer != len(attended):
        # Shards reached over NCCL enqueue the step's layers in order without waiting for each message.
        raise InvalidRequestError(f"layer {layer} attended before layer {len(attended)}: with shards reached "
                                  "over NCCL a step attends its layers in order 0, 1, ... (as a model runs them)")


def check_qkv(cfg: ServiceConfig, num_tokens: int, q, k, v, check_finite: bool) -> None:
    """q [T, Hq, D], k and v [T, Hk, D]: dense tensors of the service's dtype on one CPU or CUDA device.
    ``check_finite``: NaN or inf is refused here (else the step checks on the device and rolls back)."""
    t, hq, hk, d = num_tokens, cfg.num_q_heads, cfg.num_kv_heads, cfg.head_size
    if not _plainly_valid(cfg.torch_dtype, q, k, v, (t, hq, d), (t, hk, d)):
        _refuse(cfg, q, (("q", q, hq), ("k", k, hk), ("v", v, hk)), t, d)
    if not check_finite:
        return
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not bool(torch.isfinite(x).all()):
            raise InvalidRequestError(f"{name} holds NaN or inf; they would poison the KV cache "
                                      "(set nan_policy='allow' to accept them)")


def _plainly_valid(dtype: torch.dtype, q, k, v, q_shape: tuple, kv_shape: tuple) -> bool:
    """The common case in one expression (~5 us per layer on a 2-core box where the checks one by one took ~12):
    dense tensors of the service's dtype and shapes, on one CPU or CUDA device. Anything else goes to _refuse."""
    try:
        device = q.device
        # (first: a nested tensor raises on .shape; one needing grad fails in the data plane's out= copies)
        return (not (q.is_nested or k.is_nested or v.is_nested or q.requires_grad or k.requires_grad or v.requires_grad)
                and q.dtype == dtype and k.dtype == dtype and v.dtype == dtype and q.shape == q_shape
                and k.shape == kv_shape and v.shape == kv_shape and k.device == device and v.device == device
                and device.type in ("cpu", "cuda") and q.layout == k.layout == v.layout == torch.strided)
    except AttributeError:   # not a tensor: _refuse names it
        return False


def _refuse(cfg: ServiceConfig, q, named: tuple, t: int, d: int) -> None:
    """InvalidRequestError for the first of q, k, v (``named``) that is not as check_qkv needs it, if any."""
    for name, x, heads in named:
        if not isinstance(x, torch.Tensor):
            raise InvalidRequestError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.layout != torch.strided or x.is_nested:   # sparse tensors failed later with NotImplementedError
            raise InvalidRequestError(f"{name} is a {'nested' if x.is_nested else x.layout} tensor: pass a dense "
                                      "one ([T, heads, head_size])")
        if x.requires_grad:
            raise InvalidRequestError(f"{name} requires grad, and attention through cpattn is not differentiable: "
                                      "run the model under torch.no_grad() or torch.inference_mode(), or pass "
                                      f"{name}.detach()")
        if tuple(x.shape) != (t, heads, d):
            raise InvalidRequestError(f"{name} has shape {tuple(x.shape)}, expected {(t, heads, d)} "
                                      f"(T = {t} new tokens in this step, heads, head_size)")
        if x.dtype != cfg.torch_dtype:
            raise InvalidRequestError(f"{name} has dtype {x.dtype}, the service runs {cfg.dtype}: "
                                      f"convert with .to(torch.{cfg.dtype})")
        if x.device != q.device:
            raise InvalidRequestError(f"{name} is on {x.device} but q is on {q.device}: put q, k, v on one device")
        if x.device.type not in ("cpu", "cuda"):
            # meta/other devices hold no data to send: they would fail deep inside the data plane.
            raise InvalidRequestError(f"{name} is on {x.device}: q, k and v must be CPU or CUDA tensors")


def checked_sinks(cfg: ServiceConfig, sinks, device: torch.device) -> torch.Tensor | None:
    """Sink logits [Hq] on ``device`` in the merge's precision (float64 for a float64 service), or None."""
    if sinks is None:
        return None
    hq = cfg.num_q_heads
    # Sparse and nested tensors would raise untyped errors below (torch.isfinite, .shape).
    if isinstance(sinks, torch.Tensor) and (sinks.layout != torch.strided or sinks.is_nested):
        raise InvalidRequestError(f"sinks is a {'nested' if sinks.is_nested else sinks.layout} tensor: pass a "
                                  "dense one ([num_q_heads])")
    if isinstance(sinks, torch.Tensor) and sinks.device.type not in ("cpu", "cuda"):
        raise InvalidRequestError(f"sinks is on {sinks.device}: sinks must be a CPU or CUDA tensor")
    if not isinstance(sinks, torch.Tensor) or tuple(sinks.shape) != (hq,):
        shape = tuple(sinks.shape) if isinstance(sinks, torch.Tensor) else type(sinks).__name__
        raise InvalidRequestError(f"sinks must be a tensor [num_q_heads={hq}] of sink logits, got {shape}")
    if not sinks.is_floating_point() or not bool(torch.isfinite(sinks).all()):
        raise InvalidRequestError("sinks must be finite floating-point logits, one per query head "
                                  "(pass sinks=None for a layer without sinks)")
    return sinks.detach().to(device, torch.float64 if cfg.dtype == "float64" else torch.float32)
