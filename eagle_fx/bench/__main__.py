"""`python -m eagle_fx.bench`: the same as `eagle-fx bench`."""
from eagle_fx.bench import main

main()
