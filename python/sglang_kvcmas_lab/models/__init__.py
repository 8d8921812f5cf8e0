"""Reference model forwards the labs measure with."""
