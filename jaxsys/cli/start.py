"""What the trainer does before jax is imported: from here on SIGTERM exits 75
(`jaxsys.preemption`); the process re-executes itself once with huge pages
(`jaxsys.hugepages`), the signal held back across the exec."""
from jaxsys import hugepages, preemption


def before_jax() -> None:
  preemption.install()
  with preemption.blocked_across_exec():  # a SIGTERM meanwhile reaches the new image
    hugepages.reexec_with_huge_pages()
  preemption.pause_point("imports")
