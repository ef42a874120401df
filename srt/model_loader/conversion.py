"""The GGUF conversion cache's version and completion marker (standard library only: the launcher
checks for a finished conversion without importing the converter)."""

# Bump when the output of the conversion changes, so cached conversions are redone.
CONVERTER_VERSION = "3"
# Written last into a converted folder; its presence means the folder is complete.
MARKER_FILE = "radixserve_conversion.json"
