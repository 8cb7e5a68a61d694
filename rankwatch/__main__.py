from rankwatch.cli import main

main()
