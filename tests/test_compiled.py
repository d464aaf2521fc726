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


def test_input_guards_only_keeps_the_inputs_guards_and_drops_the_closures():
    """guard_inputs_only (the chain cycle's): a new dtype still traces again and one trace serves
    every size; a value the function closes over is read at trace time only, where
    without the filter a change of it is guarded and traced again."""
    filtered_scale, full_scale = [2.0], [2.0]

    def filtered_fn(x):  # (two functions: dynamo keeps its traces per code object)
        return x * filtered_scale[0]

    def full_fn(x):
        return x * full_scale[0]
    traces = []

    def counting(gm, example_inputs):
        traces.append(gm)
        return gm.forward
    filtered = compile_dynamic(filtered_fn, fullgraph=True, backend=counting, guard_inputs_only=True)
    full = compile_dynamic(full_fn, fullgraph=True, backend=counting)
    for rows in (3, 5, 1, 4):
        x = torch.randn(rows, 2)
        torch.testing.assert_close(filtered(x), 2.0 * x)
    assert len(traces) == 1  # (every size, 1 included, in one trace: as without the filter)
    x64 = torch.ones(3, 2, dtype=torch.float64)
    torch.testing.assert_close(filtered(x64), 2.0 * x64)
    assert len(traces) == 2  # a new dtype: traced again
    torch.testing.assert_close(full(torch.ones(3, 2)), torch.full((3, 2), 2.0))
    filtered_scale[0] = full_scale[0] = 3.0
    torch.testing.assert_close(full(torch.ones(3, 2)), torch.full((3, 2), 3.0))  # guarded: traced again
    torch.testing.assert_close(filtered(torch.ones(3, 2)), torch.full((3, 2), 2.0))  # not guarded: as traced
