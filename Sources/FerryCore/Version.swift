/// Ferry's version: `ferry --version` and the uplink's User-Agent.
public enum FerryVersion {
    public static let string = "0.1.0"
}
