"""Structured output under speculation on the bundled pair: a JSON schema through generate(), each
output parsed, and the acceptance with the grammar.

    python examples/structured_output.py [--schema examples/pet_schema.json] [--backend eager]
"""
import argparse
import json
from pathlib import Path

import eagle_fx
from eagle_fx.bundled import load_pair, pair_dirs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schema", default=str(Path(__file__).with_name("pet_schema.json")), help="a JSON schema file")
    ap.add_argument("--backend", choices=["eager", "inductor"], default="eager")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    args = ap.parse_args()
    tok, base, draft = load_pair(*pair_dirs())
    model = eagle_fx.compile(base, draft, num_spec_tokens=3, backend=args.backend, max_batch_size=2, max_seq_len=512)
    schema = json.loads(Path(args.schema).read_text())
    texts = ["Describe a pet as JSON:", "My dog Rex is 3 years old and lives in Oslo."]
    prompts = [tok(t)["input_ids"] for t in texts]
    out = model.generate(prompts, max_new_tokens=args.max_new_tokens, tokenizer=tok,
                         response_format={"type": "json_schema", "json_schema": {"name": "pet", "schema": schema}})
    for text, seq in zip(texts, out.sequences):
        body = tok.decode(seq, skip_special_tokens=True)
        complete = bool(seq) and seq[-1] == tok.eos_token_id
        if complete:
            json.loads(body)  # a complete output parses (and follows the schema)
        print(f"{text!r} -> {body}{'' if complete else '  (cut at max_new_tokens)'}")
    print(f"mean acceptance length {out.stats.mean_acceptance_length:.2f} with the grammar (k=3)")


if __name__ == "__main__":
    main()
