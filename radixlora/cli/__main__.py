from radixlora.cli import main

main()
