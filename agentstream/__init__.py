"""The ground every process links: the typed config schema (`config`), the wire library (`wire`), the streamed
weights' bucket format and group that the learner and the engines share (`weights`, which needs torch: import it
where you use it, this package imports no module of its own), and the names the policy is served under (`models`).
Nothing here imports another part of the system."""
