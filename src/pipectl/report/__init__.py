"""Rendering: Rich tables and pictures built from artifacts. Functions return renderables or write
files; the CLI decides where they go. Import the sub-modules you need (`report.tables`, ...): this
package imports nothing heavy by itself.
"""

# The pictures `simulate --gantt` and `status --plot` write: what matplotlib writes without extra software.
PICTURE_FORMATS = (".png", ".svg", ".pdf")
