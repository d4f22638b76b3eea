from mopd.distill.loop import main

main()
