import CSyscall
import FerryCLI
import FoundationEssentials
import Glibc

// First, before any thread starts (see the shim). A kernel without the option keeps its default: nothing to report.
_ = ferry_disable_transparent_huge_pages()
exit(FerryCommandLine.main(arguments: Array(CommandLine.arguments.dropFirst())))
