"""Figures for the reports and curves: one matplotlib figure on the Agg canvas, never pyplot's global state.

Knows nothing of what is drawn; the study's report, the evaluation's summary and the learning curve use it.
"""


def new_figure(width: float = 7.0, height: float = 4.0):
    """(figure, axes) on the Agg canvas, without touching pyplot's global backend."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot()
