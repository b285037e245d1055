"""Cell text that the three notebooks share: smoke mode, the clock, the seed, the figure settings.

Each notebook runs on its own in a fresh kernel and cannot import another's cells, so these
lines are written into every notebook that uses them: the cells modules concatenate them into
their sources, and ``build.py`` writes the result. Changing one here changes every notebook.

The strings have no newline at either end; the text around them supplies the line breaks.
"""

# ``MIXEDOPT_SMOKE=1`` shrinks a notebook; STARTED times the whole run (see RUN_TIME).
SMOKE_AND_CLOCK = """
SMOKE = os.environ.get("MIXEDOPT_SMOKE", "0") not in ("", "0")
STARTED = time.perf_counter()
""".strip("\n")

# The end of each notebook's first code cell: a fixed seed, and what the notebook ran with.
SEED_AND_VERSIONS = """
torch.manual_seed(0)
print(
    f"torch {torch.__version__} | mixedopt {mixedopt.__version__} | "
    f"{torch.get_num_threads()} CPU threads | smoke mode: {SMOKE}"
)
""".strip("\n")

# PNG figures at a small size, in the notebooks that plot (after ``import matplotlib.pyplot``).
FIGURE_SETTINGS = """
%config InlineBackend.figure_format = 'png'
plt.rcParams["figure.dpi"] = 80
""".strip("\n")

# The settings of the notebooks that plot and write figures into docs/, after their imports.
PLOTTING_PREAMBLE = FIGURE_SETTINGS + "\n\n" + SMOKE_AND_CLOCK + "\n" + 'DOCS = Path("..") / "docs"'

# The last cell of every notebook.
RUN_TIME = (
    "code",
    """
print(f"notebook ran in {time.perf_counter() - STARTED:.0f} s (smoke mode: {SMOKE})")
""",
)
