"""Start the radixserve HTTP server: `python launch_server.py --help`."""

from srt.launch_server import main

if __name__ == "__main__":
    main()
