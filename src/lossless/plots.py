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


def save_figure(fig, path, dpi: int = 110):
    """Write `fig` as a PNG at `path` in one step (rendered in memory, then an atomic replace): a killed or
    failed report leaves the previous plot, never half of a new one."""
    import io

    from .jsonio import atomic_write

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return atomic_write(path, buf.getvalue())
