// The FerryGateway module. Its sources land in this folder.
