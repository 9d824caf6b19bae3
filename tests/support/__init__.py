"""What the tests share: generators of hostile and corrupt inputs, reference algorithms (the
cache simulator and Belady's MIN), fault injectors, and the one way a test waits for something.

The benchmarks (``benchmarks/``, also outside the package) use the generators and the cache
simulator too. Nothing of the package imports this.
"""
