"""Client programs, not served: multi-agent workflows written as SGLang frontend programs
(``sgl.function``), the side-by-side run against SGLang's radix cache, and the real text they
draw on (``datasets``). The server never imports this package."""
