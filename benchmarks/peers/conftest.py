"""The peer scripts run under other frameworks' interpreters (GPflow/TensorFlow, GPJax/JAX) and are never imported by
the project; the suite's ``--doctest-modules`` collection must not import them either."""

collect_ignore = ["gpflow_svgp.py", "gpjax_svgp.py"]
