"""eagle_fx.runtime.compiled.compile_dynamic: one trace under the runtime's settings (every size
dynamic, no duck shaping) serves every size, the settings are patched only around a call that
traces, and a call that must trace again (a new dtype) still does, under them."""
import torch

import eagle_fx.runtime.compiled as compiled_module
from eagle_fx.runtime.compiled import compile_dynamic


def _step(x, table):
    return (x @ x.T).sum(0) + table.float().sum(1).sum()


class _CountingPatches:
    """eagle_fx.runtime.compiled's fx_config, counting the patches that module applies."""

    def __init__(self, config):
        self.config, self.patches = config, 0

    def patch(self, *args, **kwargs):
        self.patches += 1
        return self.config.patch(*args, **kwargs)


def test_one_trace_serves_every_size_and_only_a_call_that_traces_patches_the_settings(monkeypatch):
    spy = _CountingPatches(compiled_module.fx_config)
    monkeypatch.setattr(compiled_module, "fx_config", spy)
    fn = compile_dynamic(_step, fullgraph=True)
    x, table = torch.randn(2, 2), torch.ones(2, 2, dtype=torch.long)  # every size 2: duck shaping would tie them
    torch.testing.assert_close(fn(x, table), _step(x, table))
    assert spy.patches == 1  # the first call traced, under the settings
    with torch.compiler.set_stance("fail_on_recompile"):  # no size is tied to another, none is specialised
        for rows, cols, width in [(3, 5, 2), (7, 4, 9), (1, 6, 1), (2, 2, 2)]:
            x, table = torch.randn(rows, cols), torch.ones(cols, width, dtype=torch.long)
            torch.testing.assert_close(fn(x, table), _step(x, table))
    assert spy.patches == 1  # calls that did not trace ran without the patches
    x64 = torch.randn(3, 4, dtype=torch.float64)  # a new dtype: guards fail, it traces again, patched
    torch.testing.assert_close(fn(x64, table), _step(x64, table))
    assert spy.patches == 2
