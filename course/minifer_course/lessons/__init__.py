"""The course's middle floor: figure builders and slider panels, one module per lesson.

Each module turns engine results into plotly figures and ipywidgets panels. Every slider
callback is a plain function (values in, figure out) so tests can call it without a kernel.
The engine never imports this package.
"""
