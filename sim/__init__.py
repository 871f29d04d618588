"""Offline simulator of a fleet of FSD replicas driven by the same policy objects as the live
controller. Never imports Ray or torch.

Entry points: :class:`sim.simulator.Simulator` (``run()`` returns a :class:`~sim.simulator.SimResult`;
nothing is written), :class:`sim.profile.Profile`, :class:`sim.workload.Workload`,
:mod:`sim.report` (JSON, plots). CLI: ``fsd sim`` / ``fsd sim compare``. See docs/sim.md.
"""
