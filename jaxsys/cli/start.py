"""What the trainer does before jax is imported: from here on SIGTERM exits 75
(`jaxsys.preemption`); the process re-executes itself once with huge pages
(`jaxsys.hugepages`), the signal held back across the exec; simulated CPU devices get
threads enough (`xla_flags.default_cpu_threads`)."""
from jaxsys import hugepages, preemption, xla_flags


def before_jax() -> None:
  preemption.install()
  xla_flags.default_cpu_threads()
  with preemption.blocked_across_exec():  # a SIGTERM meanwhile reaches the new image
    hugepages.reexec_with_huge_pages()
  preemption.pause_point("imports")
