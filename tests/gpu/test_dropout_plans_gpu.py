"""tests/attention/test_dropout_plans.py on the GPU (compiled kernels): a call with new
dropout counters reuses the plan's compiled kernel (`Launch.with_counters`) and drops its
own positions, f32 at larger sizes, against the float64 reference."""
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from attention import test_dropout_plans as cpu_tests  # noqa: E402

from nnprim.search import context  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


@pytest.fixture(autouse=True)
def on_cuda(monkeypatch):
    monkeypatch.setattr(cpu_tests, "DEVICE", "cuda")
    monkeypatch.setattr(cpu_tests, "SK", 333)
    monkeypatch.setattr(cpu_tests, "D", 64)
    yield
    context.reset()


test_forward_each_call_its_own_mask_one_plan = cpu_tests.test_forward_each_call_its_own_mask_one_plan
test_backward_each_call_its_own_mask = cpu_tests.test_backward_each_call_its_own_mask
test_quantized_decode_each_call_its_own_mask_one_plan = cpu_tests.test_quantized_decode_each_call_its_own_mask_one_plan
