"""What Step.attend accepts (cpattn/step_inputs.py), checked alone without a service (issue 19): every rejection
names the argument, what it got and the fix. The service tests check the same through a running step."""

from __future__ import annotations

import pytest
import torch

from conftest import service_config
from cpattn.errors import InvalidRequestError
from cpattn.step_inputs import check_layer, check_qkv, checked_sinks

CFG = service_config(num_layers=3, num_q_heads=4, num_kv_heads=2, head_size=8, dtype="float64")


def _qkv(t=5, dtype=torch.float64):
    return torch.randn(t, 4, 8, dtype=dtype), torch.randn(t, 2, 8, dtype=dtype), torch.randn(t, 2, 8, dtype=dtype)


def test_layers_once_each_and_in_order_when_asked():
    check_layer(CFG, 2, {0}, in_order=False)
    for layer, match in ((3, r"layer 3 out of range: use an int in 0..2"), (True, "layer True out of range"),
                         (0, "layer 0 was already attended in this step")):
        with pytest.raises(InvalidRequestError, match=match):
            check_layer(CFG, layer, {0}, in_order=False)
    with pytest.raises(InvalidRequestError, match="layer 2 attended before layer 1: with shards reached over NCCL"):
        check_layer(CFG, 2, {0}, in_order=True)


def test_qkv_shape_dtype_device_and_finiteness():
    q, k, v = _qkv()
    check_qkv(CFG, 5, q, k, v, check_finite=True)
    with pytest.raises(InvalidRequestError, match=r"k has shape \(4, 2, 8\), expected \(5, 2, 8\)"):
        check_qkv(CFG, 5, q, k[:4], v, check_finite=True)
    with pytest.raises(InvalidRequestError, match=r"q has dtype torch.float32, the service runs float64"):
        check_qkv(CFG, 5, *_qkv(dtype=torch.float32), check_finite=True)
    with pytest.raises(InvalidRequestError, match="v must be a torch.Tensor, got list"):
        check_qkv(CFG, 5, q, k, [1.0], check_finite=True)
    with pytest.raises(InvalidRequestError, match=r"k is a torch.sparse_coo tensor: pass a dense one"):
        check_qkv(CFG, 5, q, k.to_sparse(), v, check_finite=True)
    with pytest.raises(InvalidRequestError, match="v is on meta but q is on cpu"):
        check_qkv(CFG, 5, q, k, v.to("meta"), check_finite=True)
    v[1, 0, 3] = float("nan")
    with pytest.raises(InvalidRequestError, match="v holds NaN or inf; they would poison the KV cache"):
        check_qkv(CFG, 5, q, k, v, check_finite=True)
    check_qkv(CFG, 5, q, k, v, check_finite=False)      # checked on the device instead


def test_sinks_are_finite_logits_one_per_query_head():
    assert checked_sinks(CFG, None, torch.device("cpu")) is None
    sinks = checked_sinks(CFG, torch.tensor([0.5, -1.0, 2.0, 0.0]), torch.device("cpu"))
    assert sinks.dtype == torch.float64 and sinks.tolist() == [0.5, -1.0, 2.0, 0.0]
    with pytest.raises(InvalidRequestError, match=r"sinks must be a tensor \[num_q_heads=4\] .* got \(3,\)"):
        checked_sinks(CFG, torch.zeros(3), torch.device("cpu"))
    with pytest.raises(InvalidRequestError, match="sinks must be finite floating-point logits"):
        checked_sinks(CFG, torch.tensor([0.0, float("inf"), 0.0, 0.0]), torch.device("cpu"))
    with pytest.raises(InvalidRequestError, match="sinks must be a tensor .* got list"):
        checked_sinks(CFG, [0.0] * 4, torch.device("cpu"))


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
def test_nested_tensors_and_tensors_needing_grad_are_refused_by_name():
    """A nested (strided) tensor raised an untyped RuntimeError from .shape; q/k/v needing grad (a model run
    without torch.no_grad()) failed as a data-plane error whose advice (run the step again) could never work."""
    q, k, v = _qkv()
    nested = torch.nested.nested_tensor(list(k.unbind(0)))
    with pytest.raises(InvalidRequestError, match=r"k is a nested tensor: pass a dense one \(\[T, heads, head_size"):
        check_qkv(CFG, 5, q, nested, v, check_finite=True)
    for name, args in (("q", (q.clone().requires_grad_(), k, v)), ("v", (q, k, v.clone().requires_grad_()))):
        with pytest.raises(InvalidRequestError, match=rf"{name} requires grad, and attention through cpattn is not "
                                                      rf"differentiable: run the model under torch.no_grad\(\)"):
            check_qkv(CFG, 5, *args, check_finite=True)
    with torch.no_grad():   # made under no_grad: accepted
        check_qkv(CFG, 5, q * 1.0, k, v, check_finite=True)
    with pytest.raises(InvalidRequestError, match=r"sinks is a nested tensor: pass a dense one"):
        checked_sinks(CFG, torch.nested.nested_tensor([torch.zeros(4)]), torch.device("cpu"))
    grad_sinks = torch.zeros(4, requires_grad=True)   # an nn.Parameter's sinks need grad even under no_grad: read
    assert checked_sinks(CFG, grad_sinks, torch.device("cpu")).requires_grad is False
