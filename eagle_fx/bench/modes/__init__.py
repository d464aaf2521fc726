"""One module per bench mode; each has run(...) -> its part of the result dict."""
