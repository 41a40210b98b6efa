"""Where a session's faults go when the target is not one pid: a
container, a cgroup, a pod, a process name, the ranks of a job
(select.py), and who each target process is in every view (identity.py).
docs/containers.md says how each is found."""
