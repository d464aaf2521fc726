"""The eagle_fx bench, with vLLM's spec_decode flags; the same code as `eagle-fx bench`.

    python examples/spec_decode.py                 # bundled tiny pair, held-out ShareGPT prompts
    python examples/spec_decode.py --compare       # + HF greedy, static+compile, assisted, side by side
    python examples/spec_decode.py --help
"""
from eagle_fx.bench import main

if __name__ == "__main__":
    main()
