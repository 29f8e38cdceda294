import FerryCore

/// A usage mistake: printed as one line, exit status 2.
public struct UsageError: Error, CustomStringConvertible {
    public var description: String
    public init(_ description: String) { self.description = description }
}

/// Minimal, strict argument parsing: `--name value`, `--name=value`, boolean `--flag`, positionals, `--`.
/// Unknown options are errors (a typo must not silently change behaviour).
struct ParsedArguments {
    var values: [String: String] = [:]
    var flags: Set<String> = []
    var positionals: [String] = []

    init(_ arguments: [String], command: String, options: Set<String>, flags allowedFlags: Set<String>) throws {
        var index = 0
        var onlyPositionals = false
        while index < arguments.count {
            let argument = arguments[index]
            index += 1
            if onlyPositionals || argument == "-" || !argument.hasPrefix("-") {
                positionals.append(argument)
                continue
            }
            if argument == "--" {
                onlyPositionals = true
                continue
            }
            var name = argument
            var inlineValue: String?
            if let eq = argument.firstIndex(of: "=") {
                name = String(argument[..<eq])
                inlineValue = String(argument[argument.index(after: eq)...])
            }
            if allowedFlags.contains(name) {
                guard inlineValue == nil else { throw UsageError("\(name) takes no value (ferry \(command))") }
                flags.insert(name)
            } else if options.contains(name) {
                if let inlineValue {
                    values[name] = inlineValue
                } else {
                    guard index < arguments.count else { throw UsageError("\(name) needs a value (ferry \(command))") }
                    values[name] = arguments[index]
                    index += 1
                }
            } else {
                throw UsageError("unknown option \(name) for 'ferry \(command)'; see 'ferry \(command) --help'")
            }
        }
    }

    func required(_ name: String, command: String) throws -> String {
        guard let value = values[name], !value.isEmpty else {
            throw UsageError("missing \(name) (ferry \(command))")
        }
        return value
    }

    func integer<T: FixedWidthInteger>(_ name: String, _ type: T.Type, default fallback: T, range: ClosedRange<T>? = nil)
        throws -> T
    {
        guard let text = values[name] else { return fallback }
        guard let value = T(text), range.map({ $0.contains(value) }) ?? true else {
            let bounds = range.map { " (\($0.lowerBound)...\($0.upperBound))" } ?? ""
            throw UsageError("\(name) must be a whole number\(bounds), got '\(text)'")
        }
        return value
    }

    /// A bounded range for every number: seconds and hours become `Duration`s and milliseconds, which have limits.
    func number(_ name: String, default fallback: Double, range: ClosedRange<Double>) throws -> Double {
        guard let text = values[name] else { return fallback }
        guard let value = Double(text), range.contains(value) else {
            let bounds = "\(plainNumber(range.lowerBound))...\(plainNumber(range.upperBound))"
            throw UsageError("\(name) must be a number (\(bounds)), got '\(text)'")
        }
        return value
    }
}
