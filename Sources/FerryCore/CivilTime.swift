/// Proleptic Gregorian calendar arithmetic on day numbers (days since 1970-01-01), and RFC 3339 UTC text,
/// with integer arithmetic only: no locale, time zone database or DateFormatter, so the same instant always
/// gives the same bytes (an uplink retry must resend an identical body). Algorithms from Howard Hinnant's
/// "chrono-Compatible Low-Level Date Algorithms".
public enum CivilTime {
    public static func civil(fromDays days: Int64) -> (year: Int64, month: Int, day: Int) {
        let z = days + 719_468
        let era = (z >= 0 ? z : z - 146_096) / 146_097
        let dayOfEra = z - era * 146_097
        let yearOfEra = (dayOfEra - dayOfEra / 1460 + dayOfEra / 36_524 - dayOfEra / 146_096) / 365
        let dayOfYear = dayOfEra - (365 * yearOfEra + yearOfEra / 4 - yearOfEra / 100)
        let mp = (5 * dayOfYear + 2) / 153
        let day = Int(dayOfYear - (153 * mp + 2) / 5 + 1)
        let month = Int(mp < 10 ? mp + 3 : mp - 9)
        return (yearOfEra + era * 400 + (month <= 2 ? 1 : 0), month, day)
    }

    public static func days(fromCivil year: Int64, month: Int, day: Int) -> Int64 {
        let y = month <= 2 ? year - 1 : year
        let era = (y >= 0 ? y : y - 399) / 400
        let yearOfEra = y - era * 400
        let m = Int64(month)
        let dayOfYear = (153 * (m > 2 ? m - 3 : m + 9) + 2) / 5 + Int64(day) - 1
        let dayOfEra = yearOfEra * 365 + yearOfEra / 4 - yearOfEra / 100 + dayOfYear
        return era * 146_097 + dayOfEra - 719_468
    }

    /// `2026-11-30T15:00:00.123Z`: RFC 3339 UTC with exactly three fractional digits. Floor division, so
    /// -1 ms is 1969-12-31T23:59:59.999Z.
    public static func rfc3339(millisecondsSince1970 ms: Int64) -> String {
        let (days, msOfDay) = floorDivide(ms, by: 86_400_000)
        let (year, month, day) = civil(fromDays: days)
        let seconds = msOfDay / 1000
        var text = ""
        text.reserveCapacity(24)
        text += pad(year, 4) + "-" + pad(Int64(month), 2) + "-"
        text += pad(Int64(day), 2) + "T" + pad(seconds / 3600, 2) + ":"
        text += pad(seconds / 60 % 60, 2) + ":" + pad(seconds % 60, 2)
        text += "." + pad(msOfDay % 1000, 3) + "Z"
        return text
    }

    /// Floor division and the matching non-negative remainder.
    public static func floorDivide(_ value: Int64, by divisor: Int64) -> (quotient: Int64, remainder: Int64) {
        let quotient = value / divisor
        let remainder = value % divisor
        return remainder < 0 ? (quotient - 1, remainder + divisor) : (quotient, remainder)
    }

    /// Zero-padded decimal.
    public static func pad(_ value: Int64, _ width: Int) -> String {
        let digits = String(value)
        return digits.count >= width ? digits : String(repeating: "0", count: width - digits.count) + digits
    }
}
