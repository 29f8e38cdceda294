public enum FerryCommandLine {
    public static func main(arguments: [String]) -> Int32 { 0 }
}
