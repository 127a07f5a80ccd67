from hfaccel.cli import main

main()
