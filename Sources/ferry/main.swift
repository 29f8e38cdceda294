import CSyscall
import FerryCLI
import FoundationEssentials
import Glibc

// First, before any thread starts (see the shim for both). Neither failing is worth a word: the process keeps the
// kernel's or glibc's default.
_ = ferry_disable_transparent_huge_pages()
_ = ferry_use_one_malloc_arena()
exit(FerryCommandLine.main(arguments: Array(CommandLine.arguments.dropFirst())))
