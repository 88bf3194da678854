from roseserve.cli import main

main()
