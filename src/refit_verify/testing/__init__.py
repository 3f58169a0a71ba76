"""HF layouts of tiny models (configs and tensors) for the demo, the tests and the benchmarks.

May import nothing of refit-verify.
"""
