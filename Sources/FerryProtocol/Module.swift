// The FerryProtocol module. Its sources land in this folder.
