import FerryCLI
import Foundation

exit(FerryCommandLine.main(arguments: Array(CommandLine.arguments.dropFirst())))
