"""The executor side of an engine step: persistent batch, processors, sampler, model runner.

``LLMEngine`` (the scheduler side) hands each step's ``SchedulerOutput`` to
``Executor.execute_model`` and gets back a ``ModelRunnerOutput``: what ran, what was sampled and
which requests the executor had to fail, in the order it failed them. The model runner behind it
is one process (``ModelRunner``) or a tensor-parallel group (``worker.executor.tensor_parallel``).
"""
