"""CTranslate2, the CPU decoder users pick for plain fast decoding, as a bench baseline.

The base is converted once (ctranslate2.converters.TransformersConverter, float32) into a cache
folder keyed by the model's files, then decoded greedily in a child process of its own: CTranslate2
and torch each keep a thread pool, and in one process they contend for the cores (measured on this
project's 2-core CPU: 552 tok/s in torch's process against 1373 in its own). The child imports
neither torch nor transformers: it maps ids to the converted vocabulary's tokens itself.

    outputs, seconds = run_peer(model_dir, prompts, output_len, eos, batch_size=1, compute_type="float32")
    rows = peer_rows(model_dir, prompts, output_len, eos)   # the bench's rows: fp32, then int8 (lossy)

compute_type "float32" decodes the converted fp32 weights as they are (compared against HF greedy
like any exact row); "int8" quantizes them when the child loads the model (lossy: its outputs may
differ from HF greedy, and the bench says so).

`pip install -e ".[peers]"` installs ctranslate2; without it the bench prints one line and skips
these rows.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

COMPUTE_TYPES = ("float32", "int8")
ROW_LABELS = {"float32": "CTranslate2 fp32", "int8": "CTranslate2 int8 (lossy)"}


def available() -> str | None:
    """None when ctranslate2 imports, else why not (one line)."""
    try:
        import ctranslate2  # noqa: F401
    except ImportError as e:
        return f"ctranslate2 is not installed ({e}); pip install -e '.[peers]' adds the CTranslate2 rows"
    return None


def cache_root() -> Path:
    return Path(os.environ.get("EAGLE_FX_CACHE", Path.home() / ".cache" / "eagle_fx")) / "ctranslate2"


def model_key(model_dir) -> str:
    """A key for the model's files: names, sizes and the bytes of its config (a retrained model in
    the same folder gets a new conversion)."""
    digest = hashlib.sha256()
    for path in sorted(Path(model_dir).iterdir()):
        if path.is_file():
            digest.update(f"{path.name}:{path.stat().st_size}:{path.stat().st_mtime_ns}".encode())
            if path.suffix == ".json":
                digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def convert(model_dir) -> Path:
    """The converted float32 model of `model_dir` (converted on first use, then reused)."""
    import ctranslate2

    out = cache_root() / f"{Path(model_dir).resolve().name}-{model_key(model_dir)}-float32"
    if (out / "model.bin").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:  # a finished conversion appears at once, or not at all
        staged = Path(tmp) / "model"
        ctranslate2.converters.TransformersConverter(str(model_dir)).convert(str(staged), quantization="float32")
        staged.rename(out)
    return out


def run_peer(model_dir, prompts: list[list[int]], output_len: int, eos: int | None, batch_size: int = 1,
             compute_type: str = "float32", threads: int = 0) -> tuple[list[list[int]], float]:
    """Greedy outputs of CTranslate2 on `prompts` (consecutive batches of batch_size, like the HF
    rows), decoded in a child process after one warm-up call, and the seconds spent in its
    generate calls. eos None: never stop early (exactly output_len tokens each); else each output
    ends at its first eos, kept (as HF generate returns it)."""
    if compute_type not in COMPUTE_TYPES:
        raise ValueError(f"compute_type must be one of {COMPUTE_TYPES}, got {compute_type!r}")
    converted = convert(model_dir)
    with tempfile.TemporaryDirectory() as tmp:
        job, result = Path(tmp) / "job.json", Path(tmp) / "result.json"
        job.write_text(json.dumps(dict(model=str(converted), prompts=prompts, output_len=output_len, eos=eos,
                                       batch_size=batch_size, compute_type=compute_type, threads=threads)))
        # run as a file, not as eagle_fx.bench.ctranslate2_peer: importing the package would load torch
        done = subprocess.run([sys.executable, __file__, str(job), str(result)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"the CTranslate2 child process failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
        out = json.loads(result.read_text())
    return out["outputs"], out["seconds"]


def peer_rows(model_dir, prompts, output_len: int, eos, batch_size: int = 1,
              compute_types: tuple[str, ...] = COMPUTE_TYPES) -> list[tuple]:
    """The bench's CTranslate2 rows (label, outputs, seconds), one per compute type, each decoded in
    a child process; [] with a one-line note when ctranslate2 is not installed."""
    missing = available()
    if missing:
        print(f"note: {missing}", file=sys.stderr)
        return []
    rows = []
    for compute_type in compute_types:
        print(f"{ROW_LABELS[compute_type]}: decoding in a child process", file=sys.stderr, flush=True)
        outputs, seconds = run_peer(model_dir, prompts, output_len, eos, batch_size, compute_type)
        rows.append((ROW_LABELS[compute_type], outputs, seconds))
    return rows


def _decode(job: dict) -> dict:
    """The child's work: load the converted model, warm up, decode every batch, time generate."""
    import ctranslate2

    vocab = json.loads((Path(job["model"]) / "vocabulary.json").read_text())
    generator = ctranslate2.Generator(job["model"], device="cpu", compute_type=job["compute_type"],
                                      intra_threads=job["threads"])
    eos = job["eos"]
    options = dict(max_length=job["output_len"], sampling_topk=1, include_prompt_in_result=False,
                   end_token=[] if eos is None else [eos], return_end_token=True)

    def generate(batch):
        results = generator.generate_batch([[vocab[t] for t in p] for p in batch], **options)
        return [r.sequences_ids[0] for r in results]

    prompts, size = job["prompts"], job["batch_size"]
    generate(prompts[:size])  # warm-up
    outputs, seconds = [], 0.0
    for i in range(0, len(prompts), size):
        started = time.perf_counter()
        outputs += generate(prompts[i:i + size])
        seconds += time.perf_counter() - started
    return dict(outputs=outputs, seconds=seconds)


if __name__ == "__main__":
    Path(sys.argv[2]).write_text(json.dumps(_decode(json.loads(Path(sys.argv[1]).read_text()))))
