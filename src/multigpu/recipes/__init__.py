"""Built-in workloads. Each recipe is an ordinary script that uses the public API."""
