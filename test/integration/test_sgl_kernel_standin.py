"""The sgl_kernel stand-in: used only without a real sgl_kernel, and loud when called."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from sglang_kvcmas.integration import cpu_runtime


def _load_standin():
    """Load the stand-in under a private name (never as ``sgl_kernel`` in the test process)."""
    path = cpu_runtime.STANDIN_DIR / "sgl_kernel" / "__init__.py"
    spec = importlib.util.spec_from_file_location("kvcmas_test_sgl_kernel_standin", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_any_op_raises_naming_itself(monkeypatch, tmp_path):
    log = tmp_path / "calls.log"
    monkeypatch.setenv("KVCMAS_SGL_KERNEL_STANDIN_LOG", str(log))
    standin = _load_standin()
    from_import = standin.rmsnorm  # what `from sgl_kernel import rmsnorm` does
    with pytest.raises(NotImplementedError, match=r"sgl_kernel\.rmsnorm was called"):
        from_import(1, 2)
    with pytest.raises(NotImplementedError, match=r"sgl_kernel\.silu_and_mul"):
        standin.silu_and_mul()
    calls = [line.split()[1] for line in log.read_text().splitlines()]
    assert calls == ["rmsnorm", "silu_and_mul"]
    assert standin.IS_KVCMAS_STANDIN


def test_dunder_lookups_fail_normally():
    standin = _load_standin()
    assert not hasattr(standin, "__version__")
    assert not hasattr(standin, "__wrapped__")


@pytest.fixture
def isolated_path(monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delitem(sys.modules, "sgl_kernel", raising=False)


def test_installed_only_when_no_real_sgl_kernel(isolated_path, monkeypatch):
    if importlib.util.find_spec("sgl_kernel") is not None:
        pytest.skip("a real sgl_kernel is installed here")
    env = {"PYTHONPATH": "/somewhere"}
    status = cpu_runtime.install_sgl_kernel_standin(env)
    assert status.source == "standin"
    assert sys.path[-1] == str(cpu_runtime.STANDIN_DIR)  # appended: a real one always wins
    assert env["PYTHONPATH"].split(":") == ["/somewhere", str(cpu_runtime.STANDIN_DIR)]
    spec = importlib.util.find_spec("sgl_kernel")
    assert spec is not None and str(cpu_runtime.STANDIN_DIR) in spec.origin
    again = cpu_runtime.install_sgl_kernel_standin(env)  # idempotent
    assert again == status and sys.path.count(str(cpu_runtime.STANDIN_DIR)) == 1
    assert env["PYTHONPATH"].count(str(cpu_runtime.STANDIN_DIR)) == 1


def test_real_sgl_kernel_is_never_shadowed(isolated_path, tmp_path):
    real = tmp_path / "site" / "sgl_kernel"
    real.mkdir(parents=True)
    (real / "__init__.py").write_text("REAL = True\n")
    sys.path.insert(0, str(tmp_path / "site"))
    env: dict[str, str] = {}
    status = cpu_runtime.install_sgl_kernel_standin(env)
    assert status.source == "real" and str(real) in status.location
    assert str(cpu_runtime.STANDIN_DIR) not in sys.path and env == {}


def test_cpu_server_process_env(isolated_path):
    env: dict[str, str] = {}
    cpu_runtime.prepare_cpu_server_process(env)
    assert env["SGLANG_USE_CPU_ENGINE"] == "1"
    env = {"SGLANG_USE_CPU_ENGINE": "0"}
    cpu_runtime.prepare_cpu_server_process(env)
    assert env["SGLANG_USE_CPU_ENGINE"] == "0"  # the caller's choice stands
