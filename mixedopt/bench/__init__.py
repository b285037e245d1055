"""The benchmarks of mixedopt against torch.optim; the library itself never imports this package.

Commands:

* ``python -m mixedopt.bench``: step time and memory of every optimizer (``steps``);
* ``python -m mixedopt.bench.small``: the many-small-parameters regime alone;
* ``python -m mixedopt.bench.launches``: kernel launches of the accelerator path, on any machine;
* ``python -m mixedopt.bench.in_backward``: memory and speed of ``step_in_backward()``;
* ``python -m mixedopt.bench.threads``: training throughput of N threads, each with its own model
  and optimizer.
"""
