"""The minifer course's helpers, apart from the engine a learner reads (the `minifer` package).

- `lessons`: one module of figures, slider panels and calculators per lesson;
- `roofline`: the roofline arithmetic the lessons reason with (pure arithmetic, it never measures);
- `quality`: how far a quantized or speculative model's output is from the reference's;
- `workload`: synthetic serving workloads (Poisson arrivals, length distributions);
- `bench`: the measurements the course's claims rest on (``python -m minifer_course.bench``);
- `training`: how the shipped Shakespeare models were made (``python -m minifer_course.training``).

Nothing in `minifer` imports this package.
"""
