"""eagle_fx.runtime.compiled.compile_dynamic: one trace under the runtime's settings (every size
dynamic, no duck shaping) serves every size, and a call that must trace again (a new dtype) still
does, under them."""
import torch

from eagle_fx.runtime.compiled import compile_dynamic
from torch.fx.experimental import _config as fx_config


def _step(x, table):
    return (x @ x.T).sum(0) + table.float().sum(1).sum()


def test_one_trace_serves_every_size_and_a_new_dtype_traces_again_under_the_settings():
    fn = compile_dynamic(_step, fullgraph=True)
    x, table = torch.randn(2, 2), torch.ones(2, 2, dtype=torch.long)  # every size 2: duck shaping would tie them
    torch.testing.assert_close(fn(x, table), _step(x, table))
    with torch.compiler.set_stance("fail_on_recompile"):  # no size is tied to another, none is specialised
        for rows, cols, width in [(3, 5, 2), (7, 4, 9), (1, 6, 1), (2, 2, 2)]:
            x, table = torch.randn(rows, cols), torch.ones(cols, width, dtype=torch.long)
            torch.testing.assert_close(fn(x, table), _step(x, table))
    x64 = torch.randn(3, 4, dtype=torch.float64)  # a new dtype: guards fail, it traces again, under the settings
    torch.testing.assert_close(fn(x64, table), _step(x64, table))
    with torch.compiler.set_stance("fail_on_recompile"):
        x64 = torch.randn(5, 7, dtype=torch.float64)
        table = torch.ones(7, 3, dtype=torch.long)
        torch.testing.assert_close(fn(x64, table), _step(x64, table))
    assert fx_config.use_duck_shape  # the settings hold inside calls only
