"""tokenbridge"""
